// A webhook receiver: verifies Standard Webhooks signatures and applies each
// event once with idem_inbox_accept, in the transaction of its write.
// failEvery: for every n-th event, commit it and then answer 500 (a lost
// acknowledgement), so that the relay delivers it again.
// receiver_applied has no unique key: only the inbox keeps an event to one
// row, so the chaos test can count them. An error while handling a delivery
// is recorded in receiver_errors. brokenInbox (to probe the chaos test):
// apply every delivery, first or not.
import http from "node:http";
import { createHmac, timingSafeEqual } from "node:crypto";

export function verifySignature(secret, id, timestamp, body, signatureHeader, now = Date.now()) {
  if (!id || !timestamp || !signatureHeader) return false;
  if (Math.abs(now / 1000 - Number(timestamp)) > 300) return false;
  const key = Buffer.from(secret.replace(/^whsec_/, ""), "base64");
  const expected = createHmac("sha256", key).update(`${id}.${timestamp}.${body}`).digest();
  return signatureHeader.split(" ").some((entry) => {
    const [version, sig] = entry.split(",");
    if (version !== "v1" || !sig) return false;
    const given = Buffer.from(sig, "base64");
    return given.length === expected.length && timingSafeEqual(given, expected);
  });
}

export async function startReceiver({ pool, secret, failEvery = 0, port = 0, brokenInbox = false }) {
  await pool.query(`CREATE TABLE IF NOT EXISTS receiver_applied (
      event_id text NOT NULL, type text NOT NULL, payment_id int NOT NULL, applied_at timestamptz DEFAULT now());
    CREATE INDEX IF NOT EXISTS receiver_applied_event ON receiver_applied (event_id);
    CREATE TABLE IF NOT EXISTS receiver_deliveries (event_id text NOT NULL, at timestamptz DEFAULT now());
    CREATE TABLE IF NOT EXISTS receiver_errors (event_id text, error text NOT NULL, at timestamptz DEFAULT now())`);
  let seq = 0;
  const server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (c) => { body += c; });
    req.on("end", async () => {
      const id = req.headers["webhook-id"];
      if (!verifySignature(secret, id, req.headers["webhook-timestamp"], body, req.headers["webhook-signature"])) {
        res.writeHead(401).end();
        return;
      }
      const client = await pool.connect();
      try {
        await client.query("INSERT INTO receiver_deliveries (event_id) VALUES ($1)", [id]);
        await client.query("BEGIN");
        const { rows } = await client.query("SELECT idem_inbox_accept('webhooks:payments', $1) AS first", [id]);
        const event = JSON.parse(body);
        // Plain INSERT, no ON CONFLICT: the inbox is what keeps it to once.
        if (rows[0].first || brokenInbox)
          await client.query("INSERT INTO receiver_applied (event_id, type, payment_id) VALUES ($1, $2, $3)",
            [id, event.type, event.payment_id]);
        await client.query("COMMIT");
        const lose = rows[0].first && failEvery > 0 && ++seq % failEvery === 0;
        res.writeHead(lose ? 500 : 204).end();
      } catch (err) {
        await client.query("ROLLBACK").catch(() => undefined);
        await pool.query("INSERT INTO receiver_errors (event_id, error) VALUES ($1, $2)", [id, String(err)])
          .catch(() => undefined);
        res.writeHead(500).end(String(err));
      } finally {
        client.release();
      }
    });
  });
  return new Promise((resolve) => server.listen(port, "127.0.0.1", () =>
    resolve({ server, url: `http://127.0.0.1:${server.address().port}` })));
}

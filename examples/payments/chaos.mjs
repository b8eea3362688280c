// The chaos test: clients with the retrying fetch go through a proxy that
// drops connections after the service produced its response; each intent is
// submitted twice at once (a double click); the service is killed with
// SIGKILL between capture phases and restarted. Afterwards: one charge per
// intent at the gateway, one payment per intent in the database, the same
// answer for every submit of a key, each event applied once by the receiver.
// Exit status 0 only if every check holds.
// CHAOS_BROKEN_INBOX=1 breaks the receiver's deduplication (it applies every
// delivery): the check "each event applied once" must then fail.
import http from "node:http";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { createIdempotentFetch } from "@idempotency/pg";
import { startWorld } from "./setup.mjs";

const INTENTS = Number(process.env.CHAOS_INTENTS ?? 12);
const PARALLEL = 4;
// The whole test, with margin under 4 minutes (test/node.sh kills it at 5):
// the clients retry until the deadline, whatever the number of attempts, and
// the events are awaited until it too; past it by 20 s, the test stops
// everything and fails.
const started = Date.now();
const deadline = started + 200_000;
setTimeout(async () => {
  console.log("chaos: FAILED, still running 20 s past its deadline; stopping");
  await Promise.race([world?.stop(), new Promise((r) => setTimeout(r, 10_000))]).catch(() => undefined);
  process.exit(1);
}, deadline + 20_000 - started).unref();

// Drops every third response after the service produced it (the client sees a
// reset connection). A request waits until the service answers after a
// restart; one that meets the service dying is a 502 (retried).
function startProxy(target, whenReady) {
  let n = 0;
  const stats = { dropped: 0, forwarded: 0 };
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", async () => {
      await whenReady();
      const up = http.request(target + req.url, { method: req.method, headers: req.headers }, (upRes) => {
        const body = [];
        upRes.on("data", (c) => body.push(c));
        upRes.on("end", () => {
          if (req.method === "POST" && ++n % 3 === 1) {
            stats.dropped++;
            return req.socket.destroy();
          }
          stats.forwarded++;
          res.writeHead(upRes.statusCode, upRes.headers);
          res.end(Buffer.concat(body));
        });
        upRes.on("error", () => req.socket.destroy());
      });
      up.on("error", () => { res.writeHead(502).end(); });
      up.end(Buffer.concat(chunks));
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () =>
    resolve({ server, stats, url: `http://127.0.0.1:${server.address().port}` })));
}

const log = (line) => console.log(line);
let world;
world = await startWorld({
  killEvery: 3, receiverFailEvery: 4, brokenInbox: process.env.CHAOS_BROKEN_INBOX === "1", log: () => undefined,
});
const proxy = await startProxy(world.serviceUrl, world.whenReady);
// One client per submit: it gives up only at the deadline, never by count.
const client = (url, init) => createIdempotentFetch({
  baseDelayMs: 50, maxDelayMs: 1000, attemptTimeoutMs: 15_000,
  maxAttempts: Infinity, maxElapsedMs: Math.max(0, deadline - Date.now()),
})(url, init);
let failures = 0;
const check = (name, fn) => {
  try {
    fn();
    log(`check ${name} ... ok`);
  } catch (err) {
    failures++;
    log(`check ${name} ... FAILED: ${err.message}`);
  }
};

// Send the same intent twice at once; both must end with the same answer.
async function doubleSubmit(path, body, key) {
  const send = () => client(proxy.url + path, {
    method: "POST", idempotencyKey: key,
    headers: { "content-type": "application/json", "x-tenant": "chaos" },
    body: JSON.stringify(body),
  }).then(async (r) => ({ status: r.status, body: await r.text() }));
  return Promise.all([send(), send()]);
}

const intents = Array.from({ length: INTENTS }, (_, i) => ({ amount: 100 + i, create: randomUUID(), capture: randomUUID() }));
const answers = [];
try {
  for (let i = 0; i < intents.length; i += PARALLEL) {
    await Promise.all(intents.slice(i, i + PARALLEL).map(async (intent) => {
      const created = await doubleSubmit("/payments", { amount: intent.amount }, intent.create);
      answers.push({ key: intent.create, answers: created });
      intent.created = created;
      intent.payment = JSON.parse(created[0].body).id;
      const captured = await doubleSubmit(`/payments/${intent.payment}/capture`, {}, intent.capture);
      answers.push({ key: intent.capture, answers: captured });
      intent.captured = captured[0];
    }));
  }
} catch (err) {
  failures++;
  log(`a client gave up: ${err.message}`);
}
log(`${INTENTS} intents; proxy dropped ${proxy.stats.dropped} responses; service killed and restarted ${world.restarts()} times`);

check("chaos happened (responses dropped, service killed)", () => {
  assert.ok(proxy.stats.dropped > 0);
  assert.ok(world.restarts() > 0);
});
check("every submit of a key got the same answer", () => {
  for (const a of answers) {
    assert.equal(a.answers[0].status, a.answers[1].status, a.key);
    assert.deepEqual(JSON.parse(a.answers[0].body), JSON.parse(a.answers[1].body), a.key);
  }
  assert.equal(answers.length, 2 * INTENTS);
});
check("every payment was created (201) and captured (200)", () => {
  for (const intent of intents) {
    assert.equal(intent.captured?.status, 200);
    assert.equal(JSON.parse(intent.captured.body).status, "captured");
  }
});
const { rows: payments } = await world.cluster.query(
  "SELECT created_with, count(*)::int AS n, max(charge_id) AS charge FROM payments GROUP BY created_with");
const { rows: paymentRows } = await world.cluster.query(
  "SELECT id, amount, status, charge_id, created_with FROM payments");
check("each answer is the database's payment created with that key", () => {
  const byKey = new Map(paymentRows.map((p) => [p.created_with, p]));
  for (const intent of intents) {
    const row = byKey.get(intent.create);
    assert.ok(row, `no payment created with key ${intent.create}`);
    for (const created of intent.created ?? []) {
      assert.equal(created.status, 201, intent.create);
      assert.deepEqual(JSON.parse(created.body), { id: row.id, amount: row.amount, status: "created" }, intent.create);
    }
    for (const captured of answers.find((a) => a.key === intent.capture)?.answers ?? []) {
      assert.equal(captured.status, 200, intent.capture);
      assert.deepEqual(JSON.parse(captured.body),
        { id: row.id, amount: row.amount, status: row.status, charge_id: row.charge_id }, intent.capture);
    }
  }
});
check("one payment per intent in the database", () => {
  assert.equal(payments.length, INTENTS);
  assert.ok(payments.every((p) => p.n === 1));
  assert.deepEqual(new Set(payments.map((p) => p.created_with)), new Set(intents.map((i) => i.create)));
});
check("one charge per intent at the gateway, the one the database recorded", () => {
  const charges = [...world.gateway.charges.values()];
  assert.equal(charges.length, INTENTS);
  assert.equal(new Set(charges.map((c) => c.payment_id)).size, INTENTS);
  assert.deepEqual(new Set(charges.map((c) => c.id)), new Set(payments.map((p) => p.charge)));
});
// Each of the 2 events per intent reaches the receiver (the relay retries the
// lost acknowledgements) and is applied once: receiver_applied has no unique
// key, so an event applied twice is two rows. Awaited until the relay has
// nothing left for the receiver (every delivery acknowledged): no
// redelivery can come after the count.
while (Date.now() < deadline) {
  const { rows } = await world.cluster.query(
    "SELECT backlog, delivered FROM idem_outbox_stats WHERE destination = 'receiver'");
  if (rows[0] && Number(rows[0].backlog) === 0 && Number(rows[0].delivered) >= 2 * INTENTS) break;
  await new Promise((r) => setTimeout(r, 200));
}
const { rows: applied } = await world.cluster.query(
  "SELECT event_id, min(type) AS type, min(payment_id) AS payment_id, count(*)::int AS n FROM receiver_applied GROUP BY event_id");
const { rows: redelivered } = await world.cluster.query(
  "SELECT count(*)::int AS n FROM (SELECT event_id FROM receiver_deliveries GROUP BY event_id HAVING count(*) > 1) d");
const { rows: receiverErrors } = await world.cluster.query("SELECT event_id, error FROM receiver_errors");
check("the receiver applied each event once (redeliveries included)", () => {
  const twice = applied.filter((a) => a.n > 1);
  assert.deepEqual(twice.map((a) => `${a.event_id} applied ${a.n} times`), []);
  assert.deepEqual(receiverErrors.map((e) => `${e.event_id}: ${e.error}`), [], "the receiver failed on a delivery");
  assert.equal(applied.length, 2 * INTENTS);
  const kinds = new Set(applied.map((a) => `${a.type}:${a.payment_id}`));
  assert.equal(kinds.size, 2 * INTENTS);
  assert.ok(redelivered[0].n > 0, "no event was delivered twice: the dedup was not exercised");
});
log(`${redelivered[0].n} events delivered more than once`);

proxy.server.close();
await world.stop();
log(failures === 0 ? "chaos: all checks passed" : `chaos: ${failures} checks failed`);
process.exit(failures === 0 ? 0 : 1);

// The payments service, a process of its own (the chaos test kills it with
// SIGKILL). Connection: the PG* environment variables; PORT; GATEWAY_URL.
// CHAOS_KILL_EVERY=n: the first capture of every n-th payment kills this
// process (SIGKILL) between the gateway charge and the phase that records it.
import express from "express";
import pg from "pg";
import { defaultScope, idempotent } from "@idempotency/pg";

const pool = new pg.Pool({ max: 20 });
const gateway = process.env.GATEWAY_URL;
const killEvery = Number(process.env.CHAOS_KILL_EVERY ?? 0);
// The principal: a real service takes it from authentication, never the body.
const principal = (req) => req.get("x-tenant") ?? "demo";

const app = express();
app.use(express.json());

// Create a payment: one transaction holds the claim, the row, the event and
// the stored response.
app.post("/payments", idempotent({ pool, principal, ttl: "2 days" }), async (req, res) => {
  const amount = Number(req.body?.amount);
  if (!Number.isInteger(amount) || amount <= 0)
    return res.status(422).json({ error: "amount must be a positive integer" });
  const db = req.idempotency.client;
  const { rows } = await db.query(
    "INSERT INTO payments (amount, status, created_with) VALUES ($1, 'created', $2) RETURNING id, amount, status",
    [amount, req.idempotency.key]);
  const payment = rows[0];
  await db.query("SELECT idem_publish('payment.created', $1::jsonb, key => $2)",
    [JSON.stringify({ type: "payment.created", payment_id: payment.id, amount }), `payment-${payment.id}`]);
  res.status(201).location(`/payments/${payment.id}`).json(payment);
});

// Capture: a multi-phase operation around the gateway call.
app.post("/payments/:id/capture", idempotent({ pool, principal, lease: "2 seconds", ttl: "2 days" }), async (req, res) => {
  const idem = req.idempotency;
  const id = Number(req.params.id);
  // Phase 1: the payment exists and is not captured by another operation.
  if (idem.recoveryPoint === null) {
    const found = await idem.phase("capturing", async (db) => {
      const { rows } = await db.query(
        "UPDATE payments SET status = 'capturing' WHERE id = $1 AND status = 'created' RETURNING amount", [id]);
      return rows[0];
    });
    if (!found) return res.status(409).json({ error: "no such payment awaiting capture" });
  }
  // Crashed after the last phase, before its response was stored: answer
  // from the database, and publish nothing twice.
  if (idem.recoveryPoint === "captured") {
    const { rows } = await pool.query("SELECT id, amount, status, charge_id FROM payments WHERE id = $1", [id]);
    return res.status(200).json(rows[0]);
  }
  // Phase 2: the gateway, with a key it deduplicates on. After a takeover the
  // outcome of the last owner's call is unknown: ask the gateway first.
  const chargeKey = await idem.downstreamKey("charge");
  let charge;
  const known = await fetch(`${gateway}/charges/${chargeKey}`);
  if (known.status === 200) charge = await known.json();
  else {
    const { rows } = await pool.query("SELECT amount FROM payments WHERE id = $1", [id]);
    const r = await fetch(`${gateway}/charges`, {
      method: "POST",
      headers: { "content-type": "application/json", "idempotency-key": chargeKey },
      body: JSON.stringify({ payment_id: id, amount: rows[0].amount }),
    });
    if (r.status !== 201) return res.status(502).json({ error: "gateway failed" });
    charge = await r.json();
  }
  if (killEvery > 0 && idem.recoveryPoint === null && id % killEvery === 0) {
    console.log(`chaos: kill -9 between phases of payment ${id}`);
    process.kill(process.pid, "SIGKILL");
  }
  // Phase 3: record the charge and announce it, in one transaction.
  const payment = await idem.phase("captured", async (db) => {
    const { rows } = await db.query(
      "UPDATE payments SET status = 'captured', charge_id = $2 WHERE id = $1 RETURNING id, amount, status, charge_id",
      [id, charge.id]);
    await db.query("SELECT idem_publish('payment.captured', $1::jsonb, key => $2)",
      [JSON.stringify({ type: "payment.captured", payment_id: id, charge_id: charge.id }), `payment-${id}`]);
    return rows[0];
  });
  res.status(200).json(payment);
});

// What happened to my request? The stored outcome of a key, read-only.
app.get("/operations/:key", async (req, res) => {
  const tenant = principal(req);
  const { rows } = await pool.query(
    `SELECT s.scope, r.state, r.status, r.body, r.completed_at, r.expires_at
       FROM unnest($2::text[]) AS s(scope), LATERAL idem_replay(s.scope, $1) AS r`,
    [req.params.key, [defaultScope(tenant, "POST", "/payments"), defaultScope(tenant, "POST", "/payments/:id/capture")]]);
  if (rows.length === 0) return res.status(404).json({ error: "unknown or expired key" });
  res.json(rows[0]);
});

app.use((err, req, res, next) => {
  console.error(err);
  res.status(500).json({ error: "internal error" });
});

const server = app.listen(Number(process.env.PORT ?? 3000), "127.0.0.1", () =>
  console.log(`payments service on http://127.0.0.1:${server.address().port}`));

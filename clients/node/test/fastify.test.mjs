// The Fastify 5 plugin, including a multi-phase (lease) route, against a real PostgreSQL.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import Fastify from "fastify";
import { fastifyIdempotency } from "../dist/index.js";
import { startCluster } from "./support/cluster.mjs";

let cluster, pool, app;
let crashAfterFirstPhase = true;
let neverCalls = 0, neverEntered, neverRelease;

before(async () => {
  cluster = await startCluster();
  pool = cluster.pool({ max: 10 });
  await cluster.query("CREATE TABLE orders (id serial PRIMARY KEY, amount int, state text, charge text)");
  app = Fastify();
  await app.register(fastifyIdempotency, { pool, principal: (req) => req.headers["x-tenant"] });
  app.post("/orders", async (req, reply) => {
    const { amount, fail } = req.body;
    const { rows } = await req.idempotency.client.query(
      "INSERT INTO orders (amount, state) VALUES ($1, 'new') RETURNING id", [amount]);
    if (fail) return reply.code(502).send({ error: "upstream" });
    return reply.code(201).header("location", `/orders/${rows[0].id}`).send({ id: rows[0].id });
  });
  app.post("/free", { config: { idempotency: false } }, async () => ({ free: true }));
  // Multi-phase: phase 1 writes the order, phase 2 "charges" with the
  // downstream key; a takeover resumes from the recovery point.
  app.post("/checkout", { config: { idempotency: { lease: "1 second" } } }, async (req, reply) => {
    const idem = req.idempotency;
    let orderId;
    if (idem.recoveryPoint === null) {
      orderId = await idem.phase("order_created", async (client) =>
        (await client.query("INSERT INTO orders (amount, state) VALUES ($1, 'created') RETURNING id",
          [req.body.amount])).rows[0].id);
      if (crashAfterFirstPhase) {
        crashAfterFirstPhase = false;
        throw new Error("crash between phases");
      }
    } else {
      orderId = (await cluster.query("SELECT max(id) AS id FROM orders WHERE state = 'created'")).rows[0].id;
    }
    const charge = await idem.downstreamKey("charge");
    await idem.phase("charged", (client) =>
      client.query("UPDATE orders SET state = 'charged', charge = $2 WHERE id = $1", [orderId, charge]));
    return reply.code(201).send({ order: orderId, charge, resumedFrom: idem.recoveryPoint });
  });
  app.post("/binary", async (req, reply) =>
    reply.type("image/png").send(Buffer.from([0x89, 0x50, 0, 0xff, 0xfe, 0])));
  app.post("/hijacked", async (req, reply) => {
    reply.hijack();
    reply.raw.end("sent around the middleware");
  });
  // Does not answer the first time (until the test lets it).
  app.post("/never", async () => {
    if (++neverCalls === 1) {
      neverEntered();
      await new Promise((resolve) => { neverRelease = resolve; });
    }
    return { calls: neverCalls };
  });
  await app.listen({ port: 0, host: "127.0.0.1" });
});

after(async () => {
  await app.close();
  await cluster.stop();
});

function post(url, payload, headers = {}) {
  return app.inject({ method: "POST", url, payload, headers: { "x-tenant": "t1", ...headers } });
}

test("replay, mismatch, missing key", async () => {
  const r1 = await post("/orders", { amount: 1 }, { "idempotency-key": "f-1" });
  assert.equal(r1.statusCode, 201);
  assert.equal(r1.headers["idempotent-replayed"], undefined);
  const r2 = await post("/orders", { amount: 1 }, { "idempotency-key": "f-1" });
  assert.equal(r2.statusCode, 201);
  assert.equal(r2.headers["idempotent-replayed"], "true");
  assert.equal(r2.headers.location, r1.headers.location);
  assert.deepEqual(r2.json(), r1.json());
  const r3 = await post("/orders", { amount: 2 }, { "idempotency-key": "f-1" });
  assert.equal(r3.statusCode, 422);
  assert.match(r3.headers["content-type"], /^application\/problem\+json/);
  const r4 = await post("/orders", { amount: 1 });
  assert.equal(r4.statusCode, 400);
  const { rows } = await cluster.query("SELECT count(*)::int AS n FROM orders WHERE amount IN (1, 2)");
  assert.equal(rows[0].n, 1);
});

test("a 5xx is not stored and its writes roll back", async () => {
  for (let i = 0; i < 2; i++) {
    const r = await post("/orders", { amount: 3, fail: true }, { "idempotency-key": "f-502" });
    assert.equal(r.statusCode, 502);
    assert.equal(r.headers["idempotent-replayed"], undefined);
  }
  const { rows } = await cluster.query("SELECT count(*)::int AS n FROM orders WHERE amount = 3");
  assert.equal(rows[0].n, 0);
});

test("a binary body is stored and replayed byte for byte", async () => {
  const r1 = await post("/binary", {}, { "idempotency-key": "f-bin" });
  assert.equal(r1.statusCode, 200);
  assert.deepEqual([...r1.rawPayload], [0x89, 0x50, 0, 0xff, 0xfe, 0]);
  const r2 = await post("/binary", {}, { "idempotency-key": "f-bin" });
  assert.equal(r2.headers["idempotent-replayed"], "true");
  assert.equal(r2.headers["content-type"], "image/png");
  assert.deepEqual([...r2.rawPayload], [0x89, 0x50, 0, 0xff, 0xfe, 0]);
});

test("a route can opt out", async () => {
  const r = await post("/free", {});
  assert.equal(r.statusCode, 200);
  assert.deepEqual(r.json(), { free: true });
});

test("multi-phase: a failure between phases is resumed from the recovery point by the retry", async () => {
  const r1 = await post("/checkout", { amount: 9 }, { "idempotency-key": "f-co" });
  assert.equal(r1.statusCode, 500);
  // The failed attempt released its lease: the retry takes over at once.
  const r2 = await post("/checkout", { amount: 9 }, { "idempotency-key": "f-co" });
  assert.equal(r2.statusCode, 201);
  const body = r2.json();
  assert.equal(body.resumedFrom, "order_created");
  const r3 = await post("/checkout", { amount: 9 }, { "idempotency-key": "f-co" });
  assert.equal(r3.headers["idempotent-replayed"], "true");
  assert.deepEqual(r3.json(), body);
  const { rows } = await cluster.query("SELECT state, charge FROM orders WHERE amount = 9");
  assert.deepEqual(rows, [{ state: "charged", charge: body.charge }]);
  const key = await cluster.query("SELECT idem_downstream_key('\"t1\" POST /checkout', 'f-co', 'charge') AS k");
  assert.equal(body.charge, key.rows[0].k);
});

test("a client that disconnects from a handler that never answers frees the claim", async () => {
  const base = `http://127.0.0.1:${app.server.address().port}`;
  const entered = new Promise((resolve) => { neverEntered = resolve; });
  const abort = new AbortController();
  const send = (signal) => fetch(base + "/never", {
    method: "POST", signal,
    headers: { "content-type": "application/json", "x-tenant": "t1", "idempotency-key": "f-never" }, body: "{}",
  });
  const gone = send(abort.signal).catch(() => "aborted");
  await entered;
  abort.abort();
  assert.equal(await gone, "aborted");
  // The claim is given up when the connection closes: a retry executes
  // (it waits for the abandoned attempt's transaction, then claims).
  const retry = await Promise.race([
    send(),
    new Promise((resolve) => setTimeout(resolve, 20_000, "still held after 20 s")),
  ]);
  assert.equal(retry.status, 200);
  assert.deepEqual(await retry.json(), { calls: 2 });
  neverRelease();
});

test("the plugin refuses options without principal (or principal: null)", async () => {
  const other = Fastify();
  await assert.rejects(other.register(fastifyIdempotency, { pool }).ready(), /principal/);
  await other.close();
});

test("reply.hijack() on an idempotent route fails loudly, before anything is sent", async () => {
  const r = await post("/hijacked", {}, { "idempotency-key": "f-hijack" });
  assert.equal(r.statusCode, 500);
  assert.match(r.body, /hijack/);
  const { rows } = await cluster.query("SELECT count(*)::int AS n FROM idem_replay('\"t1\" POST /hijacked', 'f-hijack')");
  assert.equal(rows[0].n, 0);
});

// The Express 5 middleware against a real PostgreSQL with the extension.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import express from "express";
import { idempotent } from "../dist/index.js";
import { startCluster } from "./support/cluster.mjs";

let cluster, pool, impatientPool, server, base;
let neverCalls = 0, neverEntered, neverRelease;
let patientPool, shortEntered, shortRelease;
let inHandler, releaseHandler;

before(async () => {
  cluster = await startCluster();
  pool = cluster.pool({ max: 10 });
  impatientPool = cluster.pool({ max: 2, options: "-c idempotency.wait_timeout=0" });
  patientPool = cluster.pool({ max: 3, options: "-c idempotency.wait_timeout=600s" });
  await cluster.query("CREATE TABLE payments (id serial PRIMARY KEY, tenant text, amount int, note text)");

  const app = express();
  app.use(express.json());
  const principal = (req) => req.get("x-tenant");
  app.post("/payments", idempotent({ pool, principal }), async (req, res) => {
    const { amount, fail, note } = req.body;
    const { rows } = await req.idempotency.client.query(
      "INSERT INTO payments (tenant, amount, note) VALUES ($1, $2, $3) RETURNING id",
      [req.get("x-tenant"), amount, note ?? null]);
    if (note === "slow") await req.idempotency.client.query("SELECT pg_sleep(0.3)");
    if (fail === "throw") throw new Error("handler failed");
    if (fail === "503") return res.status(503).set("retry-after", "1").json({ error: "try again" });
    if (amount <= 0) return res.status(402).json({ error: "declined" });
    res.status(201).location(`/payments/${rows[0].id}`).json({ id: rows[0].id, amount });
  });
  app.post("/held", idempotent({ pool: impatientPool, principal: null }), async (req, res) => {
    inHandler();
    await new Promise((resolve) => { releaseHandler = resolve; });
    res.status(200).json({ done: true });
  });
  app.post("/optional", idempotent({ pool, principal: null, required: false }), (req, res) => {
    res.json({ idempotency: req.idempotency ? req.idempotency.key : null });
  });
  app.post("/text", idempotent({ pool, principal: null }), (req, res) => {
    res.type("text/plain").send("plain answer");
  });
  // A handler that writes the head itself.
  app.post("/writehead", idempotent({ pool, principal: null }), (req, res) => {
    res.writeHead(201, { "content-type": "application/json", "x-made-by": "writeHead" });
    res.end(JSON.stringify({ made: "writeHead" }));
  });
  // A handler that answers twice: only the first answer is stored and sent.
  app.post("/twice", idempotent({ pool, principal: null }), async (req, res) => {
    await req.idempotency.client.query("INSERT INTO payments (tenant, amount, note) VALUES ('t1', 77, 'twice')");
    res.status(201).json({ answer: "first" });
    try {
      res.status(200).json({ answer: "second" });
    } catch {
      // Express may refuse the second answer: either way it must not leave.
    }
  });
  // A handler whose connection is lost while it works (the server went away).
  app.post("/lost", idempotent({ pool, principal: null }), async (req, res) => {
    const { rows } = await req.idempotency.client.query("SELECT pg_backend_pid() AS pid");
    const raw = pool._clients.find((c) => c.processID === rows[0].pid);
    // (a plain 'end' listener: events.once would also listen for 'error')
    const ended = new Promise((resolve) => raw.once("end", resolve));
    await cluster.query("SELECT pg_terminate_backend($1)", [rows[0].pid]);
    await ended;   // the server's FATAL arrived while no query was running
    await req.idempotency.client.query("SELECT 1");
    res.json({ unreachable: true });
  });
  // A handler that does not answer the first time (until the test lets it).
  app.post("/never", idempotent({ pool: impatientPool, principal: null }), async (req, res) => {
    if (++neverCalls === 1) {
      neverEntered();
      await new Promise((resolve) => { neverRelease = resolve; });
    }
    res.json({ calls: neverCalls });
  });
  // Bytes that are not UTF-8 text, with a NUL.
  app.post("/binary", idempotent({ pool, principal: null }), (req, res) => {
    res.type("application/octet-stream").send(Buffer.from([0, 255, 1, 0x80, 0xc3, 0x28, 0, 10]));
  });
  // Duplicates wait at most 0 ms for the claim here, whatever the server's setting.
  app.post("/short-wait", idempotent({ pool: patientPool, principal: null, waitTimeout: 0 }), async (req, res) => {
    shortEntered();
    await new Promise((resolve) => { shortRelease = resolve; });
    res.json({ done: true });
  });
  // An error handler answering 500: the claim is released like for any 5xx.
  app.use((err, req, res, next) => res.status(500).json({ error: err.message }));
  await new Promise((resolve) => { server = app.listen(0, "127.0.0.1", resolve); });
  base = `http://127.0.0.1:${server.address().port}`;
});

after(async () => {
  await new Promise((resolve) => server.close(resolve));
  await cluster.stop();
});

function post(path, body, headers = {}) {
  return fetch(base + path, {
    method: "POST",
    headers: { "content-type": "application/json", "x-tenant": "t1", ...headers },
    body: JSON.stringify(body),
  });
}

async function count(where, values) {
  const { rows } = await cluster.query(`SELECT count(*)::int AS n FROM payments WHERE ${where}`, values);
  return rows[0].n;
}

test("a missing or malformed key is a 400 problem", async () => {
  let r = await post("/payments", { amount: 5 });
  assert.equal(r.status, 400);
  assert.equal(r.headers.get("content-type"), "application/problem+json");
  assert.equal((await r.json()).title, "Idempotency-Key is missing");
  r = await post("/payments", { amount: 5 }, { "idempotency-key": "bad key with spaces" });
  assert.equal(r.status, 400);
  assert.equal((await r.json()).title, "Idempotency-Key is malformed");
  r = await post("/payments", { amount: 5 }, { "idempotency-key": "x".repeat(256) });
  assert.equal(r.status, 400);
  assert.equal(await count("amount = 5"), 0);
});

test("the first request executes, every retry replays its stored answer", async () => {
  const first = await post("/payments", { amount: 10 }, { "idempotency-key": "k-1" });
  assert.equal(first.status, 201);
  assert.equal(first.headers.get("idempotent-replayed"), null);
  const body = await first.json();
  for (let i = 0; i < 3; i++) {
    const again = await post("/payments", { amount: 10 }, { "idempotency-key": "k-1" });
    assert.equal(again.status, 201);
    assert.equal(again.headers.get("idempotent-replayed"), "true");
    assert.equal(again.headers.get("location"), `/payments/${body.id}`);
    assert.equal(again.headers.get("content-type"), "application/json; charset=utf-8");
    assert.deepEqual(await again.json(), body);
  }
  // The same key, spelt as the IETF draft's quoted string, is the same key.
  const quoted = await post("/payments", { amount: 10 }, { "idempotency-key": '"k-1"' });
  assert.equal(quoted.headers.get("idempotent-replayed"), "true");
  assert.equal(await count("amount = 10"), 1);
});

test("the same key with another request is a 422 problem", async () => {
  const r = await post("/payments", { amount: 11 }, { "idempotency-key": "k-1" });
  assert.equal(r.status, 422);
  assert.equal(r.headers.get("content-type"), "application/problem+json");
  assert.equal((await r.json()).status, 422);
  assert.equal(await count("amount = 11"), 0);
});

test("the scope holds the principal: another tenant's same key is another operation", async () => {
  const r = await post("/payments", { amount: 10 }, { "idempotency-key": "k-1", "x-tenant": "t2" });
  assert.equal(r.status, 201);
  assert.equal(r.headers.get("idempotent-replayed"), null);
  assert.equal(await count("amount = 10"), 2);
});

test("a business rejection (4xx) is stored and replayed", async () => {
  const r1 = await post("/payments", { amount: 0 }, { "idempotency-key": "k-402" });
  assert.equal(r1.status, 402);
  const r2 = await post("/payments", { amount: 0 }, { "idempotency-key": "k-402" });
  assert.equal(r2.status, 402);
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.equal(await count("amount = 0"), 1);
});

test("a 5xx answer is not stored and its writes roll back; the retry executes", async () => {
  const r1 = await post("/payments", { amount: 20, fail: "503" }, { "idempotency-key": "k-503" });
  assert.equal(r1.status, 503);
  assert.equal(r1.headers.get("retry-after"), "1");
  assert.equal(await count("amount = 20"), 0);
  const r2 = await post("/payments", { amount: 20, fail: "503" }, { "idempotency-key": "k-503" });
  assert.equal(r2.status, 503);
  assert.equal(r2.headers.get("idempotent-replayed"), null);
  assert.equal(await count("amount = 20"), 0);
});

test("a thrown error releases the claim; the retry executes", async () => {
  const r1 = await post("/payments", { amount: 30, fail: "throw" }, { "idempotency-key": "k-throw" });
  assert.equal(r1.status, 500);
  assert.equal(await count("amount = 30"), 0);
  // The retry with the same request (the failure was transient in reality):
  const { rows } = await cluster.query(
    "SELECT count(*)::int AS n FROM idem_replay('\"t1\" POST /payments', 'k-throw')");
  assert.equal(rows[0].n, 0);
});

test("concurrent duplicates wait for the first and replay it", async () => {
  const answers = await Promise.all(Array.from({ length: 5 }, () =>
    post("/payments", { amount: 40, note: "slow" }, { "idempotency-key": "k-conc" })
      .then(async (r) => ({ status: r.status, replayed: r.headers.get("idempotent-replayed"), body: await r.json() }))));
  assert.deepEqual(answers.map((a) => a.status), [201, 201, 201, 201, 201]);
  assert.equal(answers.filter((a) => a.replayed === null).length, 1);
  assert.equal(new Set(answers.map((a) => JSON.stringify(a.body))).size, 1);
  assert.equal(await count("amount = 40"), 1);
});

test("a duplicate of a request still in flight past wait_timeout is a 409 with Retry-After", async () => {
  const entered = new Promise((resolve) => { inHandler = resolve; });
  const first = post("/held", { n: 1 }, { "idempotency-key": "k-held" });
  await entered;
  const dup = await post("/held", { n: 1 }, { "idempotency-key": "k-held" });
  assert.equal(dup.status, 409);
  assert.ok(Number(dup.headers.get("retry-after")) >= 1);
  assert.equal((await dup.json()).title, "Request in progress");
  releaseHandler();
  assert.equal((await first).status, 200);
  const again = await post("/held", { n: 1 }, { "idempotency-key": "k-held" });
  assert.equal(again.headers.get("idempotent-replayed"), "true");
});

test("an optional key: without it the handler runs unprotected", async () => {
  let r = await post("/optional", {});
  assert.deepEqual(await r.json(), { idempotency: null });
  r = await post("/optional", {}, { "idempotency-key": "k-opt" });
  assert.deepEqual(await r.json(), { idempotency: "k-opt" });
});

test("a text response is stored and replayed byte for byte", async () => {
  const r1 = await post("/text", {}, { "idempotency-key": "k-text" });
  assert.equal(await r1.text(), "plain answer");
  const r2 = await post("/text", {}, { "idempotency-key": "k-text" });
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.equal(r2.headers.get("content-type"), "text/plain; charset=utf-8");
  assert.equal(await r2.text(), "plain answer");
});

test("writeHead() is held back and stored like setHeader()", async () => {
  const r1 = await post("/writehead", {}, { "idempotency-key": "k-wh" });
  assert.equal(r1.status, 201);
  assert.equal(r1.headers.get("x-made-by"), "writeHead");
  assert.deepEqual(await r1.json(), { made: "writeHead" });
  const r2 = await post("/writehead", {}, { "idempotency-key": "k-wh" });
  assert.equal(r2.status, 201);
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.equal(r2.headers.get("x-made-by"), "writeHead");
  assert.deepEqual(await r2.json(), { made: "writeHead" });
});

test("a second answer of the handler is dropped: the client gets the stored first one", async () => {
  const r1 = await post("/twice", {}, { "idempotency-key": "k-twice" });
  assert.equal(r1.status, 201);
  assert.deepEqual(await r1.json(), { answer: "first" });
  const r2 = await post("/twice", {}, { "idempotency-key": "k-twice" });
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.deepEqual(await r2.json(), { answer: "first" });
  assert.equal(await count("note = 'twice'"), 1);
});

test("a connection lost during the handler is a 500, not a crash; the pool goes on", async () => {
  const r = await post("/lost", {}, { "idempotency-key": "k-lost" });
  assert.equal(r.status, 500);
  const again = await post("/payments", { amount: 88 }, { "idempotency-key": "k-after-lost" });
  assert.equal(again.status, 201);
  // The lost attempt stored nothing: its retry executes.
  const { rows } = await cluster.query("SELECT count(*)::int AS n FROM idem_replay('POST /lost', 'k-lost')");
  assert.equal(rows[0].n, 0);
});

test("a client that disconnects from a handler that never answers frees the claim", async () => {
  const entered = new Promise((resolve) => { neverEntered = resolve; });
  const abort = new AbortController();
  const gone = fetch(base + "/never", {
    method: "POST", signal: abort.signal,
    headers: { "content-type": "application/json", "idempotency-key": "k-never" }, body: "{}",
  }).catch(() => "aborted");
  await entered;
  abort.abort();
  assert.equal(await gone, "aborted");
  // The claim is given up when the connection closes: a retry
  // executes (409 while the abandoned attempt still holds it).
  let retry;
  for (const until = Date.now() + 20_000; Date.now() < until;) {
    retry = await post("/never", {}, { "idempotency-key": "k-never" });
    if (retry.status !== 409) break;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  assert.equal(retry.status, 200);
  assert.equal(retry.headers.get("idempotent-replayed"), null);
  assert.deepEqual(await retry.json(), { calls: 2 });
  neverRelease();   // the abandoned handler answers at last: nothing is sent or stored
  const replay = await post("/never", {}, { "idempotency-key": "k-never" });
  assert.equal(replay.headers.get("idempotent-replayed"), "true");
  assert.deepEqual(await replay.json(), { calls: 2 });
});

test("a binary body (not UTF-8, with NUL bytes) is stored and replayed byte for byte", async () => {
  const bytes = [0, 255, 1, 0x80, 0xc3, 0x28, 0, 10];
  const r1 = await post("/binary", {}, { "idempotency-key": "k-bin" });
  assert.equal(r1.status, 200);
  assert.deepEqual([...new Uint8Array(await r1.arrayBuffer())], bytes);
  const r2 = await post("/binary", {}, { "idempotency-key": "k-bin" });
  assert.equal(r2.status, 200);
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.equal(r2.headers.get("content-type"), "application/octet-stream");
  assert.equal(r2.headers.get("idempotency-body-encoding"), null);
  assert.deepEqual([...new Uint8Array(await r2.arrayBuffer())], bytes);
});

test("the options must say whose keys they are: principal, or principal: null", async () => {
  assert.throws(() => idempotent({ pool }), /principal/);
  assert.doesNotThrow(() => idempotent({ pool, principal: null }));
  assert.doesNotThrow(() => idempotent({ pool, scope: () => "s" }));
});

test("waitTimeout: a duplicate waits that long for the claim, not idempotency.wait_timeout", async () => {
  const entered = new Promise((resolve) => { shortEntered = resolve; });
  const first = post("/short-wait", {}, { "idempotency-key": "k-short" });
  await entered;
  const dup = await Promise.race([
    post("/short-wait", {}, { "idempotency-key": "k-short" }),
    new Promise((resolve) => setTimeout(resolve, 20_000, { status: "still waiting after 20 s" })),
  ]);
  assert.equal(dup.status, 409);
  shortRelease();
  assert.equal((await first).status, 200);
});

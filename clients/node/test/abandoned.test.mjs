// A request whose client goes away (Express): its session ends, and the
// handler's later phases never run on the connection, which may by then be
// another request's. One pooled connection: whatever a request hands back to
// the pool is what the next request gets.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import express from "express";
import { idempotent } from "../dist/index.js";
import { startCluster } from "./support/cluster.mjs";

let cluster, onePool, server, base;
// Hooks of the handlers, set by each test.
const hooks = {};
let payHold = false;

before(async () => {
  cluster = await startCluster();
  onePool = cluster.pool({ max: 1 });
  await cluster.query("CREATE TABLE writes (id serial PRIMARY KEY, what text NOT NULL)");

  const app = express();
  app.use(express.json());
  // A multi-phase handler whose external call (between its phases) is slow.
  app.post("/capture", idempotent({ pool: onePool, principal: null, lease: "60 seconds" }), async (req, res) => {
    const idem = req.idempotency;
    res.on("close", () => hooks.capClosed?.());
    try {
      await idem.phase("one", (db) => db.query("INSERT INTO writes (what) VALUES ('capture phase one')"));
      hooks.capEntered?.();
      if (hooks.holdCapture) {
        hooks.holdCapture = false;
        await new Promise((resolve) => { hooks.capRelease = resolve; });   // the gateway call
      }
      await idem.phase("two", (db) => db.query("INSERT INTO writes (what) VALUES ('capture phase two')"));
      res.json({ captured: true });
    } finally {
      hooks.capDone?.();
    }
  });
  // A phase that is still running when its client goes away.
  app.post("/slow-phase", idempotent({ pool: onePool, principal: null, lease: "60 seconds" }), async (req, res) => {
    const idem = req.idempotency;
    const held = hooks.holdSlow;
    res.on("close", () => hooks.slowClosed?.());
    try {
      await idem.phase("slow", async (db) => {
        await db.query("INSERT INTO writes (what) VALUES ('slow phase, first write')");
        if (hooks.holdSlow) {
          hooks.holdSlow = false;
          hooks.slowEntered();
          await new Promise((resolve) => { hooks.slowRelease = resolve; });
        }
        await db.query("INSERT INTO writes (what) VALUES ('slow phase, second write')");
      });
      res.json({ slow: "done" });
    } finally {
      if (held) hooks.slowDone();
    }
  });
  // A handler that answers without awaiting its phase (once).
  app.post("/early", idempotent({ pool: onePool, principal: null, lease: "60 seconds" }), async (req, res) => {
    const idem = req.idempotency;
    if (hooks.answerEarly) {
      hooks.answerEarly = false;
      let firstWritten;
      const written = new Promise((resolve) => { firstWritten = resolve; });
      const phase = idem.phase("early", async (db) => {
        await db.query("INSERT INTO writes (what) VALUES ('early phase, first write')");
        firstWritten();
        await new Promise((resolve) => { hooks.earlyRelease = resolve; });
        await db.query("INSERT INTO writes (what) VALUES ('early phase, second write')");
      });
      hooks.earlyPhase = phase.then(() => "done", (err) => err.message);
      await written;
      res.json({ early: true });        // the phase is still running: a bug of the handler
      return;
    }
    await idem.phase("early", (db) => db.query("INSERT INTO writes (what) VALUES ('early phase, first write')"));
    res.json({ early: "awaited" });
  });
  // A plain handler: one write in the claim's transaction.
  app.post("/pay", idempotent({ pool: onePool, principal: null }), async (req, res) => {
    if (payHold) {
      payHold = false;
      hooks.payEntered();
      await new Promise((resolve) => { hooks.payRelease = resolve; });
    }
    await req.idempotency.client.query("INSERT INTO writes (what) VALUES ($1)", [`pay ${req.idempotency.key}`]);
    res.status(201).json({ paid: true });
  });
  app.use((err, req, res, next) => res.status(500).json({ error: err.message }));
  await new Promise((resolve) => { server = app.listen(0, "127.0.0.1", resolve); });
  base = `http://127.0.0.1:${server.address().port}`;
});

after(async () => {
  await new Promise((resolve) => server.close(resolve));
  server.closeAllConnections?.();
  await cluster.stop();
});

function post(path, key, { signal, body = {} } = {}) {
  return fetch(base + path, {
    method: "POST", signal,
    headers: { "content-type": "application/json", "idempotency-key": key },
    body: JSON.stringify(body),
  });
}

async function writes(what) {
  const { rows } = await cluster.query("SELECT count(*)::int AS n FROM writes WHERE what = $1", [what]);
  return rows[0].n;
}

const signalled = (name) => new Promise((resolve) => { hooks[name] = resolve; });

/** Retry a key until a final (non-5xx) answer, as a client would. */
async function untilFinal(path, key, first) {
  let answer = first ?? await post(path, key);
  for (let i = 0; i < 20 && answer.status >= 500; i++) answer = await post(path, key);
  return answer;
}

test("a multi-phase request abandoned between phases never touches the connection again", async () => {
  // The client of a capture goes away during the external call between its
  // phases: the session ends and its connection goes back to the pool.
  // Another request (/pay) gets that connection and is in its claim's
  // transaction when the capture handler resumes and calls phase("two").
  const capEntered = signalled("capEntered");
  const capClosed = signalled("capClosed");
  const capDone = signalled("capDone");
  hooks.holdCapture = true;
  const abort = new AbortController();
  const capture = post("/capture", "cap-1", { signal: abort.signal }).catch(() => "aborted");
  await capEntered;
  abort.abort();
  assert.equal(await capture, "aborted");
  await capClosed;

  const payEntered = signalled("payEntered");
  payHold = true;
  const pay = post("/pay", "pay-1");
  await payEntered;               // /pay holds the only connection, in its claim's transaction
  hooks.capRelease();
  await capDone;                  // the capture handler resumed: its phase two is refused
  hooks.payRelease();
  const first = await pay;
  const firstBody = await first.text();
  const final = await untilFinal("/pay", "pay-1", first);
  assert.equal(final.status, 201);
  assert.equal(await writes("pay pay-1"), 1,
    `the write of /pay happened ${await writes("pay pay-1")} times (its first answer: ${first.status} ${firstBody})`);
  assert.equal(await writes("capture phase two"), 0);
  // The capture's claim was released: its retry executes (resuming after phase one).
  hooks.capDone = undefined;
  const retried = await untilFinal("/capture", "cap-1");
  assert.equal(retried.status, 200);
  assert.equal(await writes("capture phase two"), 1);
});

test("a request abandoned during a phase: the phase rolls back, then gives the claim and connection up", async () => {
  const slowEntered = signalled("slowEntered");
  const slowClosed = signalled("slowClosed");
  const slowDone = signalled("slowDone");
  hooks.holdSlow = true;
  const abort = new AbortController();
  const slow = post("/slow-phase", "slow-1", { signal: abort.signal }).catch(() => "aborted");
  await slowEntered;              // in the phase's transaction, its first write done
  abort.abort();
  assert.equal(await slow, "aborted");
  await slowClosed;

  // /pay needs the only connection: it must not get it while the phase's
  // transaction is open. It is held in its handler if it does get it.
  const payEntered = signalled("payEntered");
  payHold = true;
  const pay = post("/pay", "pay-2");
  let payIn = false;
  payEntered.then(() => { payIn = true; });
  // Either /pay got the connection (it must not have) or it waits for it,
  // still after a round trip to the server.
  for (;;) {
    if (payIn) break;
    if (onePool.waitingCount > 0) {
      await cluster.query("SELECT pg_catalog.pg_sleep(0.1)");
      if (!payIn && onePool.waitingCount > 0) break;
    } else {
      await new Promise((r) => setTimeout(r, 10));
    }
  }
  hooks.slowRelease();            // the phase goes on: its next query is refused, it rolls back
  await slowDone;
  await payEntered;
  hooks.payRelease();
  const first = await pay;
  const firstBody = await first.text();
  const final = await untilFinal("/pay", "pay-2", first);
  assert.equal(final.status, 201);
  assert.equal(await writes("pay pay-2"), 1,
    `the write of /pay happened ${await writes("pay pay-2")} times (its first answer: ${first.status} ${firstBody})`);
  assert.equal(await writes("slow phase, first write"), 0, "the abandoned phase's write was committed");
  // The claim was released: a retry executes at once (not 409 until the lease ends).
  const retried = await post("/slow-phase", "slow-1");
  assert.equal(retried.status, 200, await retried.text());
  assert.equal(await writes("slow phase, first write"), 1);
  assert.equal(await writes("slow phase, second write"), 1);
});

test("a handler that answers while its phase still runs gets nothing stored, and the claim is given up", async () => {
  hooks.answerEarly = true;
  const first = await post("/early", "early-1");
  const body = await first.json();
  assert.equal(first.status, 500, JSON.stringify(body));
  assert.equal(body.title, "Handler answered too early");
  hooks.earlyRelease();
  // The phase's next query is refused: its transaction rolls back, then the claim is released.
  assert.match(await hooks.earlyPhase, /this request has ended/);
  assert.equal(await writes("early phase, first write"), 0);
  assert.equal(await writes("early phase, second write"), 0);
  // The connection went back clean: the retry executes and is stored.
  const retried = await untilFinal("/early", "early-1");
  assert.equal(retried.status, 200);
  assert.deepEqual(await retried.json(), { early: "awaited" });
  assert.equal(await writes("early phase, first write"), 1);
  const replay = await post("/early", "early-1");
  assert.equal(replay.headers.get("idempotent-replayed"), "true");
});

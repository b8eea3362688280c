// The principal in the key's scope: taken after the route's authentication
// (Fastify route-level preHandlers), required when the options name a
// principal function (fail closed), and unambiguous in the scope.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import Fastify from "fastify";
import express from "express";
import { fastifyIdempotency, idempotent, defaultScope } from "../dist/index.js";
import { startCluster } from "./support/cluster.mjs";

let cluster, pool, app, server, base;

before(async () => {
  cluster = await startCluster();
  pool = cluster.pool({ max: 4 });
  app = Fastify();
  app.decorateRequest("user", null);
  // The principal is the authenticated user, as the README says.
  await app.register(fastifyIdempotency, { pool, principal: (req) => req.user?.id });
  // Authentication in a route-level preHandler (the way @fastify/auth is
  // used).
  const authenticate = async (req, reply) => {
    const id = req.headers.authorization;
    if (!id) return reply.code(401).send({ error: "who are you?" });
    req.user = { id };
  };
  app.post("/statements", { preHandler: authenticate }, async (req) =>
    ({ owner: req.user.id, balance: req.user.id === "alice" ? 1000 : 5 }));
  app.post("/statements-array", { preHandler: [authenticate] }, async (req) => ({ owner: req.user.id }));
  // A route without authentication: the principal function finds nobody.
  app.post("/unauthenticated", async () => ({ shared: "by everybody" }));
  await app.ready();

  const ex = express();
  ex.use(express.json());
  ex.post("/unauthenticated", idempotent({ pool, principal: (req) => req.user?.id }), (req, res) => {
    res.json({ shared: "by everybody" });
  });
  await new Promise((resolve) => { server = ex.listen(0, "127.0.0.1", resolve); });
  base = `http://127.0.0.1:${server.address().port}`;
});

after(async () => {
  await app.close();
  await new Promise((resolve) => server.close(resolve));
  await cluster.stop();
});

const as = (user, url = "/statements", key = "same-key") => app.inject({
  method: "POST", url, payload: {},
  headers: { ...(user ? { authorization: user } : {}), "idempotency-key": key },
});

test("Fastify: the principal set by a route-level preHandler is in the scope", async () => {
  const alice = await as("alice");
  assert.equal(alice.statusCode, 200);
  assert.deepEqual(alice.json(), { owner: "alice", balance: 1000 });
  const bob = await as("bob");
  // Bob gets his own answer, never Alice's statement.
  assert.equal(bob.headers["idempotent-replayed"], undefined);
  assert.deepEqual(bob.json(), { owner: "bob", balance: 5 });
  const aliceAgain = await as("alice");
  assert.equal(aliceAgain.headers["idempotent-replayed"], "true");
  assert.deepEqual(aliceAgain.json(), { owner: "alice", balance: 1000 });
  // The same with an array of route preHandlers; a refused caller claims nothing.
  assert.equal((await as(null, "/statements-array", "k2")).statusCode, 401);
  assert.deepEqual((await as("carol", "/statements-array", "k2")).json(), { owner: "carol" });
  assert.deepEqual((await as("dave", "/statements-array", "k2")).json(), { owner: "dave" });
});

test("no principal for a request (middleware before authentication) is a 500, not a shared scope", async () => {
  const f = await as(null, "/unauthenticated", "k3");
  assert.equal(f.statusCode, 500);
  assert.match(f.headers["content-type"], /^application\/problem\+json/);
  assert.equal(f.json().title, "No principal");
  const e = await fetch(base + "/unauthenticated", {
    method: "POST", headers: { "content-type": "application/json", "idempotency-key": "k3" }, body: "{}",
  });
  assert.equal(e.status, 500);
  assert.equal((await e.json()).title, "No principal");
  const { rows } = await cluster.query("SELECT count(*)::int AS n FROM idempotency.records WHERE key = 'k3'");
  assert.equal(rows[0].n, 0, "a record was claimed without a principal");
});

test("a principal cannot spell another principal's scope", () => {
  // With "<principal>:<METHOD> <route>" these were the same scope.
  assert.notEqual(defaultScope("a:POST /x", "POST", "/y"), defaultScope("a", "POST", "/x:POST /y"));
  assert.notEqual(defaultScope("a b", "POST", "/y"), defaultScope("a", "B", "/y"));
  // Nor the scope without a principal (principal: null).
  assert.notEqual(defaultScope("POST", "POST", "/y"), defaultScope(null, "POST", "POST /y"));
  assert.equal(defaultScope("tenant-42", "post", "/payments"), '"tenant-42" POST /payments');
  assert.equal(defaultScope(null, "POST", "/payments"), "POST /payments");
});

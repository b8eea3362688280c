// A replay sends the bytes and the content type that were sent (Express and
// Fastify): JSON that res.json/reply.send writes is stored parsed (readable
// with idem_replay), any other text under a JSON content type as its text.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import express from "express";
import Fastify from "fastify";
import { idempotent, fastifyIdempotency } from "../dist/index.js";
import { startCluster } from "./support/cluster.mjs";

let cluster, pool, server, base, fast;

const JSON_TEXT = '{"zeta": 1, "id": 12345678901234567890, "amount": 10.50}';

before(async () => {
  cluster = await startCluster();
  pool = cluster.pool({ max: 4 });
  const app = express();
  app.use(express.json());
  // JSON written by the handler as text (e.g. straight from PostgreSQL's json).
  app.post("/json-text", idempotent({ pool, principal: null }), (req, res) => {
    res.type("application/json").send(JSON_TEXT);
  });
  // A JSON content type on a body that is not JSON.
  app.post("/not-json", idempotent({ pool, principal: null }), (req, res) => {
    res.type("application/json").send("OK");
  });
  // res.json: keys in jsonb's order and not.
  app.post("/res-json", idempotent({ pool, principal: null }), (req, res) => {
    res.status(201).json(req.body.zetaFirst ? { zeta: 1, id: 2 } : { id: 2, zeta: [1, "two", null] });
  });
  await new Promise((resolve) => { server = app.listen(0, "127.0.0.1", resolve); });
  base = `http://127.0.0.1:${server.address().port}`;

  fast = Fastify();
  await fast.register(fastifyIdempotency, { pool, principal: null });
  fast.post("/json-text", async (req, reply) => reply.type("application/json").send(JSON_TEXT));
  fast.post("/not-json", async (req, reply) => reply.type("application/json; charset=utf-8").send("OK"));
  await fast.ready();
});

after(async () => {
  await fast.close();
  await new Promise((resolve) => server.close(resolve));
  await cluster.stop();
});

function post(path, key, body = {}) {
  return fetch(base + path, {
    method: "POST",
    headers: { "content-type": "application/json", "idempotency-key": key },
    body: JSON.stringify(body),
  });
}

async function stored(scope, key) {
  const { rows } = await cluster.query("SELECT headers, body FROM idem_replay($1, $2)", [scope, key]);
  return rows[0];
}

test("Express: a JSON body is replayed as it was sent (byte for byte, no precision lost)", async () => {
  const r1 = await post("/json-text", "json-1");
  const sent = await r1.text();
  assert.equal(sent, JSON_TEXT);
  const r2 = await post("/json-text", "json-1");
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.equal(await r2.text(), sent);
  assert.equal(r2.headers.get("content-type"), r1.headers.get("content-type"));
  assert.equal(r2.headers.get("idempotency-body-encoding"), null);
});

test("Express: a replay has the content type that was sent, for a body that is not JSON", async () => {
  const r1 = await post("/not-json", "nj-1");
  const type = r1.headers.get("content-type");
  assert.equal(await r1.text(), "OK");
  const r2 = await post("/not-json", "nj-1");
  assert.equal(r2.headers.get("idempotent-replayed"), "true");
  assert.equal(await r2.text(), "OK");
  assert.equal(r2.headers.get("content-type"), type);
});

test("Express: res.json bodies replay byte for byte; stored parsed when jsonb keeps them so", async () => {
  for (const [key, body] of [["rj-1", {}], ["rj-2", { zetaFirst: true }]]) {
    const r1 = await post("/res-json", key, body);
    const sent = await r1.text();
    const r2 = await post("/res-json", key, body);
    assert.equal(r2.headers.get("idempotent-replayed"), "true");
    assert.equal(await r2.text(), sent, key);
  }
  // Readable with idem_replay: parsed JSON, no marker.
  const plain = await stored("POST /res-json", "rj-1");
  assert.deepEqual(plain.body, { id: 2, zeta: [1, "two", null] });
  assert.equal(plain.headers["idempotency-body-encoding"], undefined);
  // Keys that jsonb would reorder: kept as text, marked.
  const reordered = await stored("POST /res-json", "rj-2");
  assert.equal(reordered.body, '{"zeta":1,"id":2}');
  assert.equal(reordered.headers["idempotency-body-encoding"], "text");
});

test("Fastify: JSON text and a JSON content type on text are replayed as sent", async () => {
  for (const [url, expected] of [["/json-text", JSON_TEXT], ["/not-json", "OK"]]) {
    const send = () => fast.inject({ method: "POST", url, payload: {}, headers: { "idempotency-key": "f" + url } });
    const r1 = await send();
    assert.equal(r1.body, expected);
    const r2 = await send();
    assert.equal(r2.headers["idempotent-replayed"], "true");
    assert.equal(r2.body, expected, url);
    assert.equal(r2.headers["content-type"], r1.headers["content-type"], url);
  }
});

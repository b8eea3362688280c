// The retrying client against a scripted HTTP server (no database needed).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { Readable } from "node:stream";
import { createIdempotentFetch, IdempotentRequestError, retryAfterMs } from "../dist/index.js";

let server, base;
let script = [];
const seen = [];
const hung = [];

before(async () => {
  server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (c) => { body += c; });
    req.on("end", () => {
      seen.push({ key: req.headers["idempotency-key"], body, at: Date.now() });
      const step = script.shift() ?? { status: 200 };
      if (step.drop) return req.socket.destroy();
      if (step.hang) return hung.push(res);   // never answers
      res.writeHead(step.status, step.headers ?? {});
      res.end(JSON.stringify({ attempt: seen.length }));
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  base = `http://127.0.0.1:${server.address().port}`;
});

after(() => {
  for (const res of hung) res.destroy();
  server.closeAllConnections?.();
  return new Promise((resolve) => server.close(resolve));
});

function reset(steps) {
  script = steps;
  seen.length = 0;
}

test("one key per intent, kept across retries of network errors, 5xx, 429 and 409", async () => {
  reset([{ drop: true }, { status: 503 }, { status: 429 }, { status: 409, headers: { "retry-after": "0" } }, { status: 201 }]);
  const retries = [];
  const f = createIdempotentFetch({ baseDelayMs: 1, maxDelayMs: 5, onRetry: (i) => retries.push(i) });
  const r = await f(base + "/x", { method: "POST", body: '{"a":1}' });
  assert.equal(r.status, 201);
  assert.equal(seen.length, 5);
  assert.equal(new Set(seen.map((s) => s.key)).size, 1);
  assert.match(seen[0].key, /^[0-9a-f-]{36}$/);
  assert.ok(seen.every((s) => s.body === '{"a":1}'));
  assert.deepEqual(retries.map((i) => i.status), [undefined, 503, 429, 409]);
  // A second intent gets another key.
  reset([{ status: 200 }]);
  await f(base + "/x", { method: "POST", body: "{}" });
  assert.notEqual(seen[0].key, retries[0].key);
});

test("a caller's key is used as given; 4xx other than 409 and 429 are answers, not retried", async () => {
  reset([{ status: 422 }]);
  const f = createIdempotentFetch({ baseDelayMs: 1 });
  const r = await f(base + "/x", { method: "POST", body: "{}", idempotencyKey: "intent-7" });
  assert.equal(r.status, 422);
  assert.deepEqual(seen.map((s) => s.key), ["intent-7"]);
});

test("a 409 is retried only when it says 'in progress'; a replayed answer never", async () => {
  const f = createIdempotentFetch({ baseDelayMs: 1, maxDelayMs: 2 });
  // A stored 409 of the service, replayed: the answer, however it looks.
  reset([{ status: 409, headers: { "idempotent-replayed": "true", "retry-after": "1" } }, { status: 200 }]);
  let r = await f(base + "/x", { method: "POST", body: "{}" });
  assert.equal(r.status, 409);
  assert.equal(seen.length, 1);
  // Replayed 5xx/429 (a service that stores them) are answers too.
  reset([{ status: 503, headers: { "idempotent-replayed": "true" } }, { status: 200 }]);
  r = await f(base + "/x", { method: "POST", body: "{}" });
  assert.equal(r.status, 503);
  assert.equal(seen.length, 1);
  // A business 409 (a conflict of the domain): neither Retry-After nor a problem body.
  reset([{ status: 409, headers: { "content-type": "application/json" } }, { status: 200 }]);
  r = await f(base + "/x", { method: "POST", body: "{}" });
  assert.equal(r.status, 409);
  assert.equal(seen.length, 1);
  // In progress: a problem body (without Retry-After) is retried.
  reset([{ status: 409, headers: { "content-type": "application/problem+json" } }, { status: 200 }]);
  r = await f(base + "/x", { method: "POST", body: "{}" });
  assert.equal(r.status, 200);
  assert.equal(seen.length, 2);
});

test("a caller's own Idempotency-Key header is kept on every attempt", async () => {
  reset([{ status: 503 }, { status: 200 }]);
  const f = createIdempotentFetch({ baseDelayMs: 1 });
  const r = await f(base + "/x", { method: "POST", body: "{}", headers: { "Idempotency-Key": "from-header" } });
  assert.equal(r.status, 200);
  assert.deepEqual(seen.map((s) => s.key), ["from-header", "from-header"]);
});

test("Retry-After is honoured", async () => {
  reset([{ status: 409, headers: { "retry-after": "1" } }, { status: 200 }]);
  const f = createIdempotentFetch({ baseDelayMs: 1, maxDelayMs: 2 });
  const r = await f(base + "/x", { method: "POST", body: "{}" });
  assert.equal(r.status, 200);
  assert.ok(seen[1].at - seen[0].at >= 1000, `waited ${seen[1].at - seen[0].at} ms`);
});

test("backoff has full jitter within an exponential window", async () => {
  reset([{ status: 500 }, { status: 500 }, { status: 500 }, { status: 200 }]);
  const delays = [];
  const f = createIdempotentFetch({ baseDelayMs: 100, maxDelayMs: 250, random: () => 0.999, onRetry: (i) => delays.push(i.delayMs) });
  await f(base + "/x", { method: "POST", body: "{}" });
  assert.deepEqual(delays, [99, 199, 249]);
});

test("gives up after a bounded time with a typed error that carries the key", async () => {
  reset(Array.from({ length: 100 }, () => ({ status: 503 })));
  const f = createIdempotentFetch({ baseDelayMs: 20, maxDelayMs: 40, maxElapsedMs: 300, maxAttempts: 1000, random: () => 0.999 });
  await assert.rejects(f(base + "/x", { method: "POST", body: "{}", idempotencyKey: "k-gone" }), (err) => {
    assert.ok(err instanceof IdempotentRequestError);
    assert.equal(err.key, "k-gone");
    assert.equal(err.lastStatus, 503);
    assert.ok(err.attempts >= 2);
    // The time bound stopped it (waits of 19 to 39 ms fit at most 10 times in 300 ms), not maxAttempts.
    assert.ok(err.attempts <= 11, `gave up after ${err.attempts} attempts`);
    return true;
  });
  reset([]);
  const g = createIdempotentFetch({ maxAttempts: 3, baseDelayMs: 1 });
  script = [{ status: 500 }, { status: 500 }, { status: 500 }, { status: 200 }];
  await assert.rejects(g(base + "/x", { method: "POST", body: "{}" }), (err) => err.attempts === 3);
});

test("Retry-After beyond the time left gives up at once", async () => {
  reset([{ status: 429, headers: { "retry-after": "60" } }]);
  const f = createIdempotentFetch({ maxElapsedMs: 5000 });
  await assert.rejects(f(base + "/x", { method: "POST", body: "{}" }), IdempotentRequestError);
  assert.equal(seen.length, 1);
});

test("Retry-After as seconds or as a date", () => {
  assert.equal(retryAfterMs("3"), 3000);
  assert.equal(retryAfterMs(new Date(10_000).toUTCString(), 4_000), 6000);
  assert.equal(retryAfterMs("soon"), undefined);
  assert.equal(retryAfterMs(null), undefined);
});

test("the body of an answer stays readable after attemptTimeoutMs", async () => {
  // The request took effect (201): the caller must be able to read the
  // answer whenever it does so; the attempt's time limit ended with its headers.
  reset([{ status: 201 }]);
  const f = createIdempotentFetch({ attemptTimeoutMs: 100 });
  const r = await f(base + "/x", { method: "POST", body: "a" });
  assert.equal(r.status, 201);
  await new Promise((resolve) => setTimeout(resolve, 1000));
  const text = await r.text().catch((err) => `${err.name}: ${err.message}`);
  assert.equal(text, '{"attempt":1}');
});

test("a stream body (node:stream Readable, web ReadableStream, async iterable) is read once and resent", async () => {
  const bodies = [
    () => Readable.from([Buffer.from('{"a":'), Buffer.from("1}")]),
    () => new ReadableStream({ start(c) { c.enqueue(new TextEncoder().encode('{"a":1}')); c.close(); } }),
    () => (async function* () { yield '{"a":'; yield "1}"; })(),
  ];
  for (const body of bodies) {
    reset([{ status: 503 }, { status: 201 }]);
    const f = createIdempotentFetch({ baseDelayMs: 1, maxDelayMs: 2, maxAttempts: 3 });
    const r = await f(base + "/x", { method: "POST", duplex: "half", body: body() });
    assert.equal(r.status, 201);
    assert.deepEqual(seen.map((s) => s.body), ['{"a":1}', '{"a":1}']);
  }
});

test("a Request as input: its body is sent on every attempt, init overrides it", async () => {
  reset([{ status: 503 }, { status: 201 }]);
  const f = createIdempotentFetch({ baseDelayMs: 1, maxDelayMs: 2 });
  const request = new Request(base + "/x", { method: "POST", body: "from the request", headers: { "x-a": "1" } });
  const r = await f(request, { idempotencyKey: "k-request" });
  assert.equal(r.status, 201);
  assert.deepEqual(seen.map((s) => [s.key, s.body]), [["k-request", "from the request"], ["k-request", "from the request"]]);
});

test("maxElapsedMs bounds the whole call, an attempt in flight included", async () => {
  // "Give up after this long since the first attempt": 500 ms, while one
  // attempt may wait up to a minute for a server that never answers.
  reset([{ hang: true }, { hang: true }]);
  const f = createIdempotentFetch({ maxElapsedMs: 500, attemptTimeoutMs: 60_000 });
  const started = Date.now();
  const outcome = await Promise.race([
    f(base + "/x", { method: "POST", body: "a" }).then(() => "answered", (err) => err),
    new Promise((resolve) => setTimeout(resolve, 15_000, "still waiting after 15 s")),
  ]);
  assert.ok(outcome instanceof IdempotentRequestError, `${outcome} after ${Date.now() - started} ms`);
  assert.equal(outcome.cause?.name, "TimeoutError");
});

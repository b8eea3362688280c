// Express 5 middleware: claim the key before the handler, store its response
// in the same transaction before the response leaves.
import type { IncomingMessage, ServerResponse } from "node:http";
import type { Request as ExpressRequest } from "express";
import { begin, checkOptions, type HttpAnswer, type Idempotency, type IdempotencyOptions, type RequestInfo } from "./core.js";

declare module "express-serve-static-core" {
  interface Request {
    /**
     * Set by the idempotent() middleware on the routes it protects (absent
     * elsewhere, and with required: false on a request without a key).
     */
    idempotency: Idempotency;
  }
}

/** The parts of an Express request the middleware reads. */
export interface ExpressRequestLike extends IncomingMessage {
  body?: unknown;
  params?: Record<string, string | string[]>;
  route?: { path?: unknown };
  baseUrl?: string;
  path?: string;
  idempotency?: Idempotency;
}

type Next = (err?: unknown) => void;

function requestInfo(req: ExpressRequestLike): RequestInfo {
  const routePath = typeof req.route?.path === "string" ? req.route.path : undefined;
  return {
    method: req.method ?? "GET",
    route: (req.baseUrl ?? "") + (routePath ?? req.path ?? (req.url ?? "/").split("?")[0]),
    headers: req.headers,
    body: req.body,
    params: { ...(req.params ?? {}) },
  };
}

function send(res: ServerResponse, answer: HttpAnswer): void {
  res.statusCode = answer.status;
  for (const [name, value] of Object.entries(answer.headers)) res.setHeader(name, value);
  if (answer.body === null) res.end();
  else {
    res.setHeader("content-length", Buffer.byteLength(answer.body));
    res.end(answer.body);
  }
}

function toBuffer(chunk: unknown, encoding?: unknown): Buffer {
  if (Buffer.isBuffer(chunk)) return chunk;
  if (chunk instanceof Uint8Array) return Buffer.from(chunk);
  return Buffer.from(String(chunk), typeof encoding === "string" ? (encoding as BufferEncoding) : "utf8");
}

/**
 * The middleware. Mount it on the routes it protects (so that the scope has
 * the route pattern), after the body parser:
 *   app.post("/payments", idempotent({ pool, principal: (req) => req.user.id }), handler)
 */
export function idempotent<Req extends ExpressRequestLike = ExpressRequest>(options: IdempotencyOptions<Req>) {
  checkOptions(options);
  return async function idempotencyMiddleware(req: Req, res: ServerResponse, next: Next): Promise<void> {
    let started;
    try {
      started = await begin(options, req, requestInfo(req));
    } catch (err) {
      next(err);
      return;
    }
    if (started.kind === "pass") return next();
    if (started.kind === "answer") return send(res, started.answer);

    const session = started.session;
    req.idempotency = session;
    // Hold the response back until it is stored: whatever the handler (or an
    // error handler) writes is buffered; the first end() stores it and sends
    // it once the transaction committed. Until then nothing reaches the
    // socket: writeHead() and flushHeaders() only record, and every write or
    // end() after the first end() is dropped (a second answer is never sent
    // nor stored).
    const original = { write: res.write, end: res.end, writeHead: res.writeHead, flushHeaders: res.flushHeaders };
    const chunks: Buffer[] = [];
    let ended = false;
    const callLater = (cb: unknown) => { if (typeof cb === "function") process.nextTick(cb as () => void); };
    res.writeHead = function (statusCode: number, reason?: unknown, headers?: unknown) {
      if (ended) return res;
      if (typeof reason !== "string") headers = reason;
      else res.statusMessage = reason;
      res.statusCode = statusCode;
      if (Array.isArray(headers)) {
        // [[name, value], ...] or [name, value, name, value, ...]
        if (headers.length > 0 && Array.isArray(headers[0]))
          for (const [name, value] of headers as [string, string][]) res.appendHeader(name, value);
        else
          for (let i = 0; i + 1 < headers.length; i += 2) res.appendHeader(String(headers[i]), headers[i + 1]);
      } else if (headers && typeof headers === "object") {
        for (const [name, value] of Object.entries(headers as Record<string, unknown>))
          if (value !== undefined) res.setHeader(name, value as string | string[]);
      }
      return res;
    } as typeof res.writeHead;
    res.flushHeaders = function () { /* sent with the stored response */ };
    res.write = function (chunk: unknown, encoding?: unknown, cb?: unknown) {
      if (typeof encoding === "function") { cb = encoding; encoding = undefined; }
      if (!ended && chunk !== undefined && chunk !== null) chunks.push(toBuffer(chunk, encoding));
      callLater(cb);
      return !ended;
    } as typeof res.write;
    res.end = function (chunk?: unknown, encoding?: unknown, cb?: unknown) {
      if (typeof chunk === "function") { cb = chunk; chunk = undefined; }
      if (typeof encoding === "function") { cb = encoding; encoding = undefined; }
      if (ended) {
        callLater(cb);
        return res;
      }
      ended = true;
      if (chunk !== undefined && chunk !== null) chunks.push(toBuffer(chunk, encoding));
      const body = Buffer.concat(chunks);
      const headers: Record<string, string> = {};
      for (const [name, value] of Object.entries(res.getHeaders()))
        if (value !== undefined) headers[name] = Array.isArray(value) ? value.join(", ") : String(value);
      const answer: HttpAnswer = { status: res.statusCode, headers, body: body.length === 0 ? null : body };
      session.finish(answer).then((sent) => {
        Object.assign(res, original);
        if (res.headersSent || res.destroyed) {
          // The client went away meanwhile (nothing can have been sent with
          // the methods above held back): the retry replays what was stored.
          res.destroy();
          return;
        }
        // What was stored, even if the handler changed the status or the
        // headers after its first end().
        for (const name of res.getHeaderNames()) res.removeHeader(name);
        send(res, sent);
        callLater(cb);
      }).catch((err) => {
        // The answer's fate is unknown to the client: a reset connection
        // tells it to retry with the same key, which replays or executes.
        res.destroy(err instanceof Error ? err : new Error(String(err)));
      });
      return res;
    } as typeof res.end;
    // The client went away before the handler answered: give the claim up
    // now rather than when (if ever) the handler ends; its retry executes.
    res.on("close", () => {
      if (!ended) {
        ended = true;
        session.abandon().catch(() => undefined);
      }
    });
    next();
  };
}

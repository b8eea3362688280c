// Express 5 middleware: claim the key before the handler, store its response
// in the same transaction before the response leaves.
import type { IncomingMessage, ServerResponse } from "node:http";
import { begin, type HttpAnswer, type Idempotency, type IdempotencyOptions, type RequestInfo } from "./core.js";

/** The parts of an Express request the middleware reads. */
export interface ExpressRequestLike extends IncomingMessage {
  body?: unknown;
  params?: Record<string, string>;
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
 *   app.post("/payments", idempotent({ pool }), handler)
 */
export function idempotent<Req extends ExpressRequestLike = ExpressRequestLike>(options: IdempotencyOptions<Req>) {
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
    // error handler) writes is buffered and sent by the end() below.
    const originalWrite = res.write;
    const originalEnd = res.end;
    const chunks: Buffer[] = [];
    res.write = function (chunk: unknown, encoding?: unknown, cb?: unknown) {
      if (typeof encoding === "function") cb = encoding;
      if (chunk !== undefined && chunk !== null) chunks.push(toBuffer(chunk, encoding));
      if (typeof cb === "function") process.nextTick(cb as () => void);
      return true;
    } as typeof res.write;
    res.end = function (chunk?: unknown, encoding?: unknown, cb?: unknown) {
      if (typeof chunk === "function") { cb = chunk; chunk = undefined; }
      if (typeof encoding === "function") { cb = encoding; encoding = undefined; }
      if (chunk !== undefined && chunk !== null) chunks.push(toBuffer(chunk, encoding));
      res.write = originalWrite;
      res.end = originalEnd;
      const body = Buffer.concat(chunks).toString("utf8");
      const headers: Record<string, string> = {};
      for (const [name, value] of Object.entries(res.getHeaders()))
        if (value !== undefined) headers[name] = Array.isArray(value) ? value.join(", ") : String(value);
      const answer: HttpAnswer = { status: res.statusCode, headers, body: body === "" ? null : body };
      session.finish(answer).then((sent) => {
        if (sent !== answer) {
          for (const name of res.getHeaderNames()) res.removeHeader(name);
          send(res, sent);
        } else {
          res.setHeader("content-length", Buffer.byteLength(body));
          originalEnd.call(res, body, "utf8");
        }
        if (typeof cb === "function") (cb as () => void)();
      });
      return res;
    } as typeof res.end;
    next();
  };
}

// Fastify 5 plugin: the same flow as the Express middleware, with hooks.
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { begin, checkOptions, type HttpAnswer, type Idempotency, type IdempotencyOptions, type RequestInfo, type Session } from "./core.js";

declare module "fastify" {
  interface FastifyRequest {
    /** Set on the routes the plugin covers (null on the others, as on Express's req). */
    idempotency: Idempotency;
  }
  interface FastifyContextConfig {
    /** false: this route is not idempotent; an object: options for this route. */
    idempotency?: false | Partial<Omit<IdempotencyOptions<FastifyRequest>, "pool">>;
  }
}

const sessions = new WeakMap<FastifyRequest, Session>();

function requestInfo(req: FastifyRequest): RequestInfo {
  return {
    method: req.method,
    route: req.routeOptions.url ?? req.url.split("?")[0],
    headers: req.headers,
    body: req.body,
    params: { ...((req.params as Record<string, string>) ?? {}) },
  };
}

function replyWith(reply: FastifyReply, answer: HttpAnswer): FastifyReply {
  reply.code(answer.status);
  for (const [name, value] of Object.entries(answer.headers)) reply.header(name, value);
  return reply.send(answer.body ?? undefined);
}

async function idempotencyPlugin(app: FastifyInstance, options: IdempotencyOptions<FastifyRequest>): Promise<void> {
  checkOptions(options);
  // null until the route's claim sets it (typed as set: only covered routes read it).
  app.decorateRequest("idempotency", null as unknown as Idempotency);

  // The claim runs as the last preHandler of each route, after the route's
  // own (where authentication, e.g. @fastify/auth, sets the principal): an
  // app-level preHandler hook would run before them.
  app.addHook("onRoute", (route) => {
    if ((route.config as { idempotency?: unknown } | undefined)?.idempotency === false) return;
    const own = route.preHandler;
    route.preHandler = own === undefined ? [claim] : Array.isArray(own) ? [...own, claim] : [own, claim];
  });

  async function claim(req: FastifyRequest, reply: FastifyReply): Promise<unknown> {
    const routeConfig = (req.routeOptions.config as { idempotency?: false | object }).idempotency;
    if (routeConfig === false) return;
    const started = await begin({ ...options, ...(routeConfig ?? {}) }, req, requestInfo(req));
    if (started.kind === "pass") return;
    if (started.kind === "answer") return replyWith(reply, started.answer);
    sessions.set(req, started.session);
    req.idempotency = started.session;
    // A hijacked reply would leave without being stored, its writes rolled
    // back: refuse it, before anything is sent (the handler's error is a 500).
    reply.hijack = () => {
      throw new Error("idempotency: reply.hijack() is not supported on an idempotent route " +
        "(the response must be stored before it leaves); use config: { idempotency: false } on this route");
    };
    // The client went away before the handler answered: give the claim up
    // now rather than when (if ever) the handler ends; its retry executes.
    // (Fastify's onRequestAbort only fires for a request whose body was not
    // read completely.) Once the reply is sent, onSend has taken the session.
    reply.raw.on("close", () => {
      const session = sessions.get(req);
      if (session) {
        sessions.delete(req);
        session.abandon().catch(() => undefined);
      }
    });
    return undefined;
  }

  app.addHook("onSend", async (req, reply, payload) => {
    const session = sessions.get(req);
    if (!session) return payload;
    sessions.delete(req);
    let body: string | Buffer | null;
    if (payload === null || payload === undefined) body = null;
    else if (typeof payload === "string" || Buffer.isBuffer(payload)) body = payload;
    else {
      await session.abandon();
      reply.code(500).header("content-type", "application/problem+json");
      return JSON.stringify({ type: "about:blank", title: "Streamed response", status: 500,
        detail: "An idempotent route cannot stream its response: it must be stored first." });
    }
    const headers: Record<string, string> = {};
    for (const [name, value] of Object.entries(reply.getHeaders()))
      if (value !== undefined) headers[name] = Array.isArray(value) ? value.join(", ") : String(value);
    const answer: HttpAnswer = { status: reply.statusCode, headers, body };
    const sent = await session.finish(answer);
    if (sent === answer) return payload;
    for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name);
    reply.code(sent.status);
    for (const [name, value] of Object.entries(sent.headers)) reply.header(name, value);
    return sent.body;
  });

  // A request that ended without a reply being sent (aborted, or an error
  // before onSend) gives its claim up.
  app.addHook("onResponse", async (req) => {
    const session = sessions.get(req);
    if (session) {
      sessions.delete(req);
      await session.abandon();
    }
  });
}

// Like fastify-plugin: the hooks apply to every route of the instance it is
// registered on, not only inside its own encapsulation context.
(idempotencyPlugin as any)[Symbol.for("skip-override")] = true;
(idempotencyPlugin as any)[Symbol.for("fastify.display-name")] = "@idempotency/pg";
(idempotencyPlugin as any)[Symbol.for("plugin-meta")] = { name: "@idempotency/pg", fastify: "5.x" };

export { idempotencyPlugin as fastifyIdempotency };

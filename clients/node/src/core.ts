// The framework-independent part: validate the key, claim it, answer
// replays and conflicts, and store (or give up) the handler's response in the
// claim's transaction.

/** The part of a pg.Pool the middleware uses. */
export interface PoolLike {
  connect(): Promise<PoolClientLike>;
}

/** The part of a pg.PoolClient the middleware uses. */
export interface PoolClientLike {
  query(text: string, values?: unknown[]): Promise<{ rows: any[]; rowCount: number | null }>;
  release(destroy?: Error | boolean): void;
  on?(event: "error", listener: (err: Error) => void): unknown;
  removeListener?(event: "error", listener: (err: Error) => void): unknown;
}

/**
 * A client checked out of the pool, listening for its errors. pg-pool takes
 * its own 'error' listener off a client it hands out, and an 'error' event
 * without a listener (the server went away while the handler was not
 * querying) would crash the process. The error is kept and the client is
 * released as broken, so the pool closes it instead of handing it out again.
 */
export class CheckedOut {
  private error: Error | undefined;
  private readonly onError = (err: Error) => { this.error ??= err; };

  constructor(readonly raw: PoolClientLike) {
    raw.on?.("error", this.onError);
  }

  /** Give the client back: as broken if it had an error (or err is given). */
  release(err?: Error): void {
    const broken = err ?? this.error;
    // A broken client is closed by the pool: keep listening to its last gasps.
    if (!broken) this.raw.removeListener?.("error", this.onError);
    this.raw.release(broken);
  }
}

/** A client bound to the request's transaction; refuses queries once the request is finished. */
export interface TransactionClient {
  query<R = any>(text: string, values?: unknown[]): Promise<{ rows: R[]; rowCount: number | null }>;
}

/** What the middleware needs to know about a request, whatever the framework. */
export interface RequestInfo {
  method: string;
  /** The route pattern, e.g. "/payments/:id/capture"; the path when no route matched yet. */
  route: string;
  headers: Record<string, string | string[] | undefined>;
  body: unknown;
  params: Record<string, string | string[]>;
}

export interface IdempotencyOptions<Req = any> {
  /** A pg.Pool (or anything with connect()) of a database with the idempotency extension. */
  pool: PoolLike;
  /**
   * The authenticated principal (tenant, user): part of the default scope.
   * Never take it from the body. Required (unless scope is given): null says
   * on purpose that all callers share one key space. A function that returns
   * null, undefined or "" for a request refuses it (500 "No principal"):
   * give anonymous callers an explicit value (e.g. "anonymous").
   */
  principal?: ((req: Req) => string | undefined | null) | null;
  /** The scope of the key. Default: defaultScope(principal, method, route pattern), e.g. `"tenant-42" POST /payments`. */
  scope?: (req: Req, info: RequestInfo) => string;
  /** What identifies the request besides its key. Default: the JSON body, with the path parameters if there are any. */
  fingerprint?: (req: Req, info: RequestInfo) => unknown;
  /** Answer 400 when the header is missing. Default true. */
  required?: boolean;
  /** Methods the middleware acts on; others pass through. Default POST and PATCH. */
  methods?: string[];
  /** How long the response is kept (a PostgreSQL interval, e.g. "2 days"). Default: idempotency.default_ttl. */
  ttl?: string;
  /** Multi-phase handlers: the lease of the operation (e.g. "30 seconds"); see Idempotency.phase(). */
  lease?: string;
  /** The request header. Default "Idempotency-Key". */
  header?: string;
  /**
   * How long a duplicate waits for the claim of a request in flight before
   * it is answered 409 + Retry-After, in ms (SET LOCAL
   * idempotency.wait_timeout in the claim's transaction). Each waiting
   * duplicate holds a pooled connection meanwhile. Default: the server's
   * idempotency.wait_timeout.
   */
  waitTimeout?: number;
}

/** What a handler finds on req.idempotency. */
export interface Idempotency {
  readonly scope: string;
  readonly key: string;
  /** Bound to the claim's transaction (without a lease): its writes commit with the stored response. */
  readonly client: TransactionClient;
  /** The fencing token (with a lease), 1 without. */
  readonly token: string;
  /** With a lease: where a taken-over operation had got to (null: from the start). */
  readonly recoveryPoint: string | null;
  /** With a lease: run one phase in a transaction of its own that records recoveryPoint with its writes. */
  phase<T>(recoveryPoint: string, work: (client: TransactionClient) => Promise<T>): Promise<T>;
  /** With a lease: renew it for lease (an interval), returns when it now ends. */
  extend(lease?: string): Promise<Date>;
  /** The key to send to an external provider for one step: the same for every retry and owner. */
  downstreamKey(label: string): Promise<string>;
}

/** A complete HTTP answer. */
export interface HttpAnswer {
  status: number;
  headers: Record<string, string>;
  /** The body as sent (text, or bytes), or null for none. */
  body: string | Buffer | null;
}

export const REPLAYED_HEADER = "Idempotent-Replayed";

const MAX_KEY_BYTES = 255;

/**
 * Refuse options that do not say whose keys they are: without a principal in
 * the scope, one user's key replays another user's response.
 */
export function checkOptions(options: IdempotencyOptions<any>): void {
  if (!options || typeof options.pool?.connect !== "function")
    throw new TypeError("idempotency: the pool option (a pg.Pool) is required");
  if (options.scope !== undefined) return;
  if (options.principal !== null && typeof options.principal !== "function")
    throw new TypeError(
      "idempotency: pass principal: (req) => the authenticated tenant or user id (part of the key's scope), " +
      "or principal: null if every caller may share one key space");
}

/** An RFC 9457 problem answer. */
export function problem(status: number, title: string, detail: string,
                        extraHeaders: Record<string, string> = {}): HttpAnswer {
  return {
    status,
    headers: { "content-type": "application/problem+json", ...extraHeaders },
    body: JSON.stringify({ type: "about:blank", title, status, detail }),
  };
}

/**
 * The key from the header value: a bare token (as Stripe sends it) or an RFC
 * 8941 sf-string (as the IETF draft writes it); 1 to 255 printable ASCII
 * characters. undefined: absent; null: malformed.
 */
export function parseKey(raw: string | string[] | undefined): string | undefined | null {
  if (raw === undefined) return undefined;
  if (Array.isArray(raw)) return raw.length === 1 ? parseKey(raw[0]) : null;
  let key = raw.trim();
  if (key.length >= 2 && key.startsWith('"') && key.endsWith('"')) key = key.slice(1, -1);
  if (key.length === 0 || key.length > MAX_KEY_BYTES) return null;
  if (!/^[\x21-\x7e]+$/.test(key)) return null;
  return key;
}

// Headers not stored with a response: hop-by-hop, per connection, or secret.
const UNSTORED_HEADERS = new Set([
  "connection", "keep-alive", "transfer-encoding", "content-length", "date",
  "set-cookie", "upgrade", "proxy-connection", REPLAYED_HEADER.toLowerCase(), "idempotency-body-encoding",
]);

/** The headers of a response worth storing, as strings. */
export function storableHeaders(headers: Record<string, unknown>): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [name, value] of Object.entries(headers)) {
    const lower = name.toLowerCase();
    if (value === undefined || UNSTORED_HEADERS.has(lower)) continue;
    out[lower] = Array.isArray(value) ? value.join(", ") : String(value);
  }
  return out;
}

function isJsonType(contentType: string | undefined): boolean {
  return contentType !== undefined && /^application\/([a-z0-9.+-]*\+)?json\b/i.test(contentType);
}

/**
 * The stored header that says how the stored body is kept when it is not
 * parsed JSON: "base64" for bytes that are not UTF-8 text (or hold a NUL,
 * which jsonb cannot), "text" for a body with a JSON content type that a
 * replay from jsonb would not write back exactly (spacing, big integers,
 * 10.50, keys out of jsonb's order, or not JSON at all), kept as its text.
 * Taken off on replay.
 */
export const BODY_ENCODING_HEADER = "idempotency-body-encoding";

const utf8 = new TextDecoder("utf-8", { fatal: true });

/** The bytes as text, if they are UTF-8 without NUL; else undefined. */
function asText(body: string | Buffer): string | undefined {
  if (typeof body === "string") return body.includes("\u0000") ? undefined : body;
  try {
    const text = utf8.decode(body);
    return text.includes("\u0000") ? undefined : text;
  } catch {
    return undefined;
  }
}

/**
 * The value with its object keys in jsonb's order (shorter keys first, then
 * by their bytes): how a replay, read back from jsonb, writes them.
 */
function inJsonbOrder(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(inJsonbOrder);
  if (value === null || typeof value !== "object") return value;
  const keys = Object.keys(value).sort((a, b) => {
    const ab = Buffer.from(a), bb = Buffer.from(b);
    return ab.length - bb.length || Buffer.compare(ab, bb);
  });
  const out: Record<string, unknown> = {};
  for (const key of keys) out[key] = inJsonbOrder((value as Record<string, unknown>)[key]);
  return out;
}

/**
 * The text parsed, if a replay would send it back exactly: JSON.stringify
 * writes it so (what res.json sends: no spacing, no big integers, no 10.50)
 * and its keys are in jsonb's order. Else undefined.
 */
function asReplayableJson(text: string): { value: unknown } | undefined {
  try {
    const value = JSON.parse(text);
    return JSON.stringify(inJsonbOrder(value)) === text ? { value } : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The body as stored: parsed JSON for a JSON content type when a replay
 * gives back the same text, else the text (marked when its content type says
 * JSON); bytes that are not text as base64, marked; null when empty. A
 * replay sends the same bytes with the same content type.
 */
export function bodyToStore(headers: Record<string, string>, body: string | Buffer | null): unknown {
  if (body === null || body.length === 0) return null;
  const text = asText(body);
  // jsonb has no NUL: neither in a text nor in a parsed JSON string (\u0000).
  if (text === undefined || (isJsonType(headers["content-type"]) && text.includes("\\u0000"))) {
    headers[BODY_ENCODING_HEADER] = "base64";
    return Buffer.from(body).toString("base64");
  }
  if (isJsonType(headers["content-type"])) {
    const json = asReplayableJson(text);
    if (json) return json.value;
    headers[BODY_ENCODING_HEADER] = "text";
  }
  return text;
}

/** A stored response as an HTTP answer marked as a replay. */
export function replayAnswer(status: number, headers: Record<string, string> | null, body: unknown): HttpAnswer {
  const h: Record<string, string> = { ...(headers ?? {}) };
  const encoding = h[BODY_ENCODING_HEADER];
  delete h[BODY_ENCODING_HEADER];
  h[REPLAYED_HEADER.toLowerCase()] = "true";
  let out: string | Buffer | null;
  if (body === null || body === undefined) out = null;
  else if (encoding === "base64" && typeof body === "string") out = Buffer.from(body, "base64");
  else if (typeof body === "string" && (encoding === "text" || !isJsonType(h["content-type"]))) out = body;
  else out = JSON.stringify(body);
  return { status, headers: h, body: out };
}

export type Begin =
  | { kind: "pass" }
  | { kind: "answer"; answer: HttpAnswer }
  | { kind: "claimed"; session: Session };

function defaultFingerprint(info: RequestInfo): unknown {
  const body = info.body === undefined ? null : info.body;
  return Object.keys(info.params).length > 0 ? { params: info.params, body } : body;
}

/**
 * The default scope: the principal (JSON-encoded, so that no principal can
 * spell another principal's scope), the method and the route pattern, e.g.
 * `"tenant-42" POST /payments`; without a principal (principal: null),
 * `POST /payments`.
 */
export function defaultScope(principal: string | null, method: string, route: string): string {
  const operation = `${method.toUpperCase()} ${route}`;
  return principal === null ? operation : `${JSON.stringify(principal)} ${operation}`;
}

/** Claim the request's key, or say how to answer it instead. */
export async function begin<Req>(options: IdempotencyOptions<Req>, req: Req, info: RequestInfo): Promise<Begin> {
  const methods = (options.methods ?? ["POST", "PATCH"]).map((m) => m.toUpperCase());
  if (!methods.includes(info.method.toUpperCase())) return { kind: "pass" };
  const headerName = (options.header ?? "Idempotency-Key").toLowerCase();
  const key = parseKey(info.headers[headerName]);
  if (key === undefined) {
    if (options.required === false) return { kind: "pass" };
    return {
      kind: "answer",
      answer: problem(400, "Idempotency-Key is missing",
        `This operation requires an ${options.header ?? "Idempotency-Key"} header: one unique key per intent, resent on every retry.`),
    };
  }
  if (key === null)
    return {
      kind: "answer",
      answer: problem(400, "Idempotency-Key is malformed",
        "An idempotency key is 1 to 255 printable ASCII characters, bare or as a quoted string."),
    };

  let scope: string;
  if (options.scope) scope = options.scope(req, info);
  else if (options.principal === null || options.principal === undefined)
    scope = defaultScope(null, info.method, info.route);
  else {
    // Fail closed: without its principal the request would share the key
    // space of every other caller whose principal is missing.
    const principal = options.principal(req);
    if (principal === null || principal === undefined || principal === "")
      return {
        kind: "answer",
        answer: problem(500, "No principal",
          "The idempotency middleware found no principal for this request: it runs before authentication, " +
          "or the principal option returned nothing. Anonymous callers need an explicit principal value."),
      };
    scope = defaultScope(String(principal), info.method, info.route);
  }
  const fingerprint = options.fingerprint ? options.fingerprint(req, info) : defaultFingerprint(info);

  const checkedOut = new CheckedOut(await options.pool.connect());
  const client = checkedOut.raw;
  let row: any;
  try {
    await client.query("BEGIN");
    if (options.waitTimeout !== undefined)
      await client.query("SELECT pg_catalog.set_config('idempotency.wait_timeout', $1, true)",
        [`${Math.max(0, Math.round(options.waitTimeout))}ms`]);
    const result = await client.query(
      `SELECT outcome, status, headers, body, retry_after, token::text AS token, recovery_point
         FROM idem_claim($1, $2, $3::jsonb, $4::interval, $5::interval)`,
      [scope, key, JSON.stringify(fingerprint ?? null), options.ttl ?? null, options.lease ?? null]);
    row = result.rows[0];
    if (row.outcome !== "claimed" || options.lease) await client.query("COMMIT");
  } catch (err) {
    let broken: Error | undefined;
    await client.query("ROLLBACK").catch((e) => { broken = e; });
    checkedOut.release(broken);
    throw err;
  }
  switch (row.outcome) {
    case "claimed":
      return { kind: "claimed", session: new Session(checkedOut, scope, key, row.token, row.recovery_point, options.lease) };
    case "replay":
      checkedOut.release();
      return { kind: "answer", answer: replayAnswer(row.status, row.headers, row.body) };
    case "mismatch":
      checkedOut.release();
      return {
        kind: "answer",
        answer: problem(422, "Idempotency key reused with a different request",
          "This idempotency key was already used with a request that has a different fingerprint."),
      };
    default:
      checkedOut.release();
      return {
        kind: "answer",
        answer: problem(409, "Request in progress",
          "A request with this idempotency key is still being processed. Retry later.",
          { "retry-after": String(row.retry_after ?? 1) }),
      };
  }
}

/** A claimed request: the handler's transaction (or phases), then its stored response. */
export class Session implements Idempotency {
  readonly client: TransactionClient;
  /** The request has ended (answered, or abandoned by its client): no more work on the connection. */
  private finished = false;
  private inPhase = false;
  /** Operations of the handler running on the connection (a phase, extend, downstreamKey, a query). */
  private busy = 0;
  /** Abandoned while busy: the last running operation gives the claim and the connection up. */
  private cleanupPending = false;

  private readonly raw: PoolClientLike;

  constructor(private readonly checkedOut: CheckedOut, readonly scope: string, readonly key: string,
              readonly token: string, readonly recoveryPoint: string | null,
              private readonly lease: string | undefined) {
    this.raw = checkedOut.raw;
    this.client = {
      query: (text: string, values?: unknown[]) => {
        if (this.lease && !this.inPhase && !this.finished)
          return Promise.reject(new Error("idempotency: with a lease, write inside idempotency.phase()"));
        return this.running(() => this.raw.query(text, values));
      },
    };
  }

  /**
   * Run one operation of the handler on the connection, unless the request
   * has ended: once it has, the connection may belong to another request.
   * The last operation running when the request was abandoned gives the
   * claim and the connection up.
   */
  private async running<T>(work: () => Promise<T>): Promise<T> {
    if (this.finished)
      throw new Error("idempotency: this request has ended (answered, or its client went away)");
    this.busy++;
    try {
      return await work();
    } finally {
      this.busy--;
      if (this.busy === 0 && this.cleanupPending) {
        this.cleanupPending = false;
        await this.giveUp();
      }
    }
  }

  async phase<T>(recoveryPoint: string, work: (client: TransactionClient) => Promise<T>): Promise<T> {
    if (!this.lease) throw new Error("idempotency: phase() needs the lease option");
    if (this.inPhase) throw new Error("idempotency: phases do not nest");
    return this.running(async () => {
      this.inPhase = true;
      try {
        await this.raw.query("BEGIN");
        await this.raw.query("SELECT idem_checkpoint($1, $2, $3::bigint, $4)",
          [this.scope, this.key, this.token, recoveryPoint]);
        const result = await work(this.client);
        // Abandoned while the work ran: its retry redoes this phase.
        if (this.finished)
          throw new Error("idempotency: this request has ended (its client went away) during phase " + recoveryPoint);
        await this.raw.query("COMMIT");
        return result;
      } catch (err) {
        await this.raw.query("ROLLBACK").catch(() => undefined);
        throw err;
      } finally {
        this.inPhase = false;
      }
    });
  }

  async extend(lease?: string): Promise<Date> {
    if (!this.lease) throw new Error("idempotency: extend() needs the lease option");
    const r = await this.running(() => this.raw.query(
      "SELECT idem_extend($1, $2, $3::bigint, $4::interval) AS until",
      [this.scope, this.key, this.token, lease ?? this.lease]));
    return r.rows[0].until;
  }

  async downstreamKey(label: string): Promise<string> {
    const r = await this.running(() => this.raw.query(
      "SELECT idem_downstream_key($1, $2, $3) AS k", [this.scope, this.key, label]));
    return r.rows[0].k;
  }

  /**
   * The handler answered: store the answer with the claim (2xx, 3xx, 4xx) or
   * give the claim up (5xx: nothing is stored, the handler's writes roll back,
   * the next retry executes). Returns the answer to send: the handler's, or a
   * problem if it could not be stored.
   */
  async finish(answer: HttpAnswer): Promise<HttpAnswer> {
    if (this.finished) return answer;
    if (this.busy > 0) {
      // The handler answered without awaiting its own work on the connection
      // (a phase, a query): storing now would race that work on one
      // connection. Nothing is stored; the work's end gives the claim up.
      await this.abandon();
      return problem(500, "Handler answered too early",
        "The handler answered while its database work was still running, so nothing was stored. Retry with the same key.");
    }
    this.finished = true;
    let broken: Error | undefined;
    try {
      if (answer.status >= 500) {
        if (this.lease)
          await this.raw.query("SELECT idem_release($1, $2, $3::bigint)", [this.scope, this.key, this.token]);
        else
          await this.raw.query("ROLLBACK");
        return answer;
      }
      const headers = storableHeaders(answer.headers);
      const body = bodyToStore(headers, answer.body);
      if (this.lease) await this.raw.query("BEGIN");
      await this.raw.query(
        "SELECT idem_succeed($1, $2, $3, $4::jsonb, $5::jsonb" + (this.lease ? ", token => $6::bigint)" : ")"),
        [this.scope, this.key, answer.status, JSON.stringify(body), JSON.stringify(headers),
          ...(this.lease ? [this.token] : [])]);
      await this.raw.query("COMMIT");
      return answer;
    } catch (err: any) {
      await this.raw.query("ROLLBACK").catch((e) => { broken = e; });
      if (err?.code === "IK001")
        return problem(409, "Request taken over",
          "Another attempt with this idempotency key took the operation over. Retry to get its answer.",
          { "retry-after": "1" });
      broken = broken ?? (err?.code === undefined ? err : undefined);
      return problem(500, "Response not stored",
        "The response could not be stored, so the operation was not committed. Retry with the same key.");
    } finally {
      this.checkedOut.release(broken);
    }
  }

  /**
   * Give up without an answer (the client went away): roll back, release the
   * claim and free the connection; if the handler is running something on
   * the connection, that operation does it when it ends (never hand a
   * connection in use, or in a transaction, back to the pool).
   */
  async abandon(): Promise<void> {
    if (this.finished) return;
    this.finished = true;
    if (this.busy > 0) {
      this.cleanupPending = true;
      return;
    }
    await this.giveUp();
  }

  /** Roll back (or release the lease) and give the connection back to the pool. */
  private async giveUp(): Promise<void> {
    let broken: Error | undefined;
    try {
      if (this.lease)
        await this.raw.query("SELECT idem_release($1, $2, $3::bigint)", [this.scope, this.key, this.token]);
      else
        await this.raw.query("ROLLBACK");
    } catch (err: any) {
      broken = err;
    } finally {
      this.checkedOut.release(broken);
    }
  }
}

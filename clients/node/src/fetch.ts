// A fetch that sends one Idempotency-Key per intent and retries what is safe
// to retry with it: network errors, 5xx, 429 and a 409 that says "in
// progress", with exponential backoff and full jitter, honouring Retry-After,
// for a bounded time. A replayed answer (Idempotent-Replayed: true) is the
// stored outcome of the intent: it is returned, never retried.
import { randomUUID } from "node:crypto";

export interface IdempotentFetchOptions {
  /** The fetch to wrap. Default: the global fetch. */
  fetch?: typeof fetch;
  /** Give up after this long since the first attempt, in ms. Default 30000. */
  maxElapsedMs?: number;
  /** Give up after this many attempts. Default 10. */
  maxAttempts?: number;
  /** The first backoff window, in ms. Default 100. */
  baseDelayMs?: number;
  /** The largest backoff window, in ms. Default 5000. */
  maxDelayMs?: number;
  /** Abort one attempt after this long, in ms (then retry). Default 10000. */
  attemptTimeoutMs?: number;
  /** The request header. Default "Idempotency-Key". */
  header?: string;
  /**
   * Which answers are retried. Default: 429, 5xx, and 409 with Retry-After or
   * a problem body (a duplicate in progress; a plain 409 is the domain's
   * conflict). Whatever it says, a replayed answer is never retried.
   */
  retryStatus?: (status: number, response: Response) => boolean;
  /** Called before each wait. */
  onRetry?: (info: RetryInfo) => void;
  /** For tests: a source of randomness in [0, 1). */
  random?: () => number;
}

export interface RetryInfo {
  key: string;
  attempt: number;
  delayMs: number;
  status?: number;
  error?: unknown;
}

export interface IdempotentRequestInit extends RequestInit {
  /** The intent's key (or send it as the Idempotency-Key header); generated (a UUID) when absent. */
  idempotencyKey?: string;
}

/** Thrown when the retries ran out; the request may or may not have taken effect: retry later with the same key. */
export class IdempotentRequestError extends Error {
  override name = "IdempotentRequestError";
  constructor(message: string, readonly key: string, readonly attempts: number, readonly elapsedMs: number,
              readonly lastStatus: number | undefined, options?: { cause?: unknown }) {
    super(message, options);
  }
}

export type IdempotentFetch = (input: string | URL | Request, init?: IdempotentRequestInit) => Promise<Response>;

/** Seconds or an HTTP date, in ms from now; undefined if absent or unreadable. */
export function retryAfterMs(value: string | null, now = Date.now()): number | undefined {
  if (value === null) return undefined;
  const trimmed = value.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed) * 1000;
  const date = Date.parse(trimmed);
  return Number.isNaN(date) ? undefined : Math.max(0, date - now);
}

/** 429, 5xx, and a 409 that looks like "in progress" (Retry-After, or an RFC 9457 problem). */
function defaultRetryStatus(status: number, response: Response): boolean {
  if (status === 429 || status >= 500) return true;
  if (status !== 409) return false;
  return response.headers.has("retry-after") ||
    /^application\/problem\+json\b/i.test(response.headers.get("content-type") ?? "");
}

/** A stored answer replayed by the service: the intent's outcome, final. */
function isReplayed(response: Response): boolean {
  return response.headers.get("idempotent-replayed")?.trim().toLowerCase() === "true";
}

function sleep(ms: number, signal?: AbortSignal | null): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(() => { signal?.removeEventListener("abort", onAbort); resolve(); }, ms);
    const onAbort = () => { clearTimeout(timer); reject(signal!.reason); };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** A body that can be read only once: a web ReadableStream, a Node.js Readable, an async iterable. */
function isOneShotBody(body: unknown): body is AsyncIterable<unknown> | ReadableStream {
  if (body === null || typeof body !== "object") return false;
  if (ArrayBuffer.isView(body) || body instanceof ArrayBuffer || body instanceof Blob ||
      body instanceof FormData || body instanceof URLSearchParams)
    return false;
  return typeof (body as any).getReader === "function" || typeof (body as any)[Symbol.asyncIterator] === "function";
}

/** Read a one-shot body into memory, so that every attempt sends the same bytes. */
async function readBody(body: AsyncIterable<unknown> | ReadableStream): Promise<Buffer> {
  const chunks: Buffer[] = [];
  const iterable: AsyncIterable<unknown> = typeof (body as any)[Symbol.asyncIterator] === "function"
    ? body as AsyncIterable<unknown>
    : (async function* () {
      const reader = (body as ReadableStream).getReader();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) return;
        yield value;
      }
    })();
  for await (const chunk of iterable)
    chunks.push(typeof chunk === "string" ? Buffer.from(chunk) : Buffer.from(chunk as Uint8Array));
  return Buffer.concat(chunks);
}

export function createIdempotentFetch(options: IdempotentFetchOptions = {}): IdempotentFetch {
  const doFetch = options.fetch ?? globalThis.fetch;
  const maxElapsed = options.maxElapsedMs ?? 30_000;
  const maxAttempts = options.maxAttempts ?? 10;
  const base = options.baseDelayMs ?? 100;
  const cap = options.maxDelayMs ?? 5_000;
  const attemptTimeout = options.attemptTimeoutMs ?? 10_000;
  const headerName = options.header ?? "Idempotency-Key";
  const retryStatus = options.retryStatus ?? defaultRetryStatus;
  const random = options.random ?? Math.random;

  return async function idempotentFetch(input, init = {}) {
    let { idempotencyKey, ...requestInit } = init;
    // A Request's body can be read once: take its parts, init overriding them.
    if (typeof Request !== "undefined" && input instanceof Request) {
      const request = input;
      input = request.url;
      requestInit = {
        method: request.method, headers: request.headers, signal: request.signal,
        redirect: request.redirect, credentials: request.credentials, referrer: request.referrer,
        body: request.body === null ? undefined : Buffer.from(await request.arrayBuffer()),
        ...requestInit,
      };
    }
    // A stream body is sent on every attempt: read it into memory once.
    if (isOneShotBody(requestInit.body)) {
      requestInit = { ...requestInit, body: await readBody(requestInit.body) };
      delete (requestInit as { duplex?: unknown }).duplex;
    }
    const headers = new Headers(requestInit.headers);
    // The caller's own key (option or header) is the intent's; else a new one.
    const fromHeader = headers.get(headerName);
    if (idempotencyKey !== undefined && fromHeader !== null && fromHeader !== idempotencyKey)
      throw new TypeError(`idempotent fetch: idempotencyKey and the ${headerName} header differ`);
    const key = idempotencyKey ?? fromHeader ?? randomUUID();
    headers.set(headerName, key);
    const started = Date.now();
    let lastStatus: number | undefined;
    let lastError: unknown;

    for (let attempt = 1; ; attempt++) {
      let waitAtLeast = 0;
      // This attempt's time limit, within maxElapsedMs, ends when its
      // headers arrive: the body of an answer follows the caller's signal only.
      const timeLeft = maxElapsed - (Date.now() - started);
      const attemptLimit = new AbortController();
      const timer = setTimeout(
        () => attemptLimit.abort(new DOMException("the attempt timed out", "TimeoutError")),
        Math.max(0, Math.min(attemptTimeout, timeLeft)));
      try {
        const signal = requestInit.signal ? AbortSignal.any([attemptLimit.signal, requestInit.signal]) : attemptLimit.signal;
        const response = await doFetch(input, { ...requestInit, headers, signal });
        clearTimeout(timer);
        if (isReplayed(response) || !retryStatus(response.status, response)) return response;
        lastStatus = response.status;
        lastError = undefined;
        waitAtLeast = retryAfterMs(response.headers.get("retry-after")) ?? 0;
        await response.arrayBuffer().catch(() => undefined);
      } catch (err) {
        clearTimeout(timer);
        // The caller's own abort is final; anything else may be transient.
        if (requestInit.signal?.aborted) throw err;
        lastError = err;
      }
      const elapsed = Date.now() - started;
      const window = Math.min(cap, base * 2 ** (attempt - 1));
      const delay = Math.max(waitAtLeast, Math.floor(random() * window));
      if (attempt >= maxAttempts || elapsed + delay >= maxElapsed) {
        throw new IdempotentRequestError(
          `gave up after ${attempt} attempts in ${elapsed} ms (last: ${lastError !== undefined ? String(lastError) : lastStatus}); ` +
          `the request may have taken effect: retry later with key ${key}`,
          key, attempt, elapsed, lastStatus, { cause: lastError });
      }
      options.onRetry?.({ key, attempt, delayMs: delay, status: lastStatus, error: lastError });
      await sleep(delay, requestInit.signal);
    }
  };
}

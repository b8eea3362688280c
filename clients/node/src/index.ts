export {
  type Idempotency, type IdempotencyOptions, type PoolLike, type PoolClientLike, type TransactionClient,
  type RequestInfo, type HttpAnswer, parseKey, problem, defaultScope, REPLAYED_HEADER,
} from "./core.js";
export { idempotent, type ExpressRequestLike } from "./express.js";
export { fastifyIdempotency } from "./fastify.js";
export {
  createIdempotentFetch, IdempotentRequestError, retryAfterMs,
  type IdempotentFetch, type IdempotentFetchOptions, type IdempotentRequestInit, type RetryInfo,
} from "./fetch.js";

/*-------------------------------------------------------------------------
 *
 * relay_http.c
 *	  HTTP webhook delivery: libcurl multi, Standard Webhooks signatures.
 *
 * Each delivery is one POST of the event's payload (JSON) to the
 * destination's URL with the Standard Webhooks headers:
 *
 *	webhook-id			the event id, the same on every retry
 *	webhook-timestamp	Unix seconds of this attempt
 *	webhook-signature	"v1,<base64 HMAC-SHA256 of id.timestamp.body>", one
 *						per secret, separated by spaces (secret rotation)
 *
 * plus the destination's extra headers and the event's own headers (which
 * never override the destination's).  Any 2xx is a delivery; 410 Gone also
 * disables the destination; everything else (other statuses, timeouts,
 * refused connections) is a failure to retry.  Redirects are not followed.
 *
 * Requests run concurrently on one libcurl multi handle, at most
 * idempotency.relay_max_in_flight at a time.  The multi handle lives as long
 * as the backend, so its connection cache keeps connections alive from one
 * pass to the next.  While waiting, the relay checks for interrupts every few
 * milliseconds; if it is interrupted, every request in flight is abandoned
 * (their claims stay, and expire).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <curl/curl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
#include <openssl/core_names.h>
#endif

#include "common/base64.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/uuid.h"

#include "outbox.h"
#include "relay_http.h"

/* How long one wait for network activity lasts before interrupts are checked. */
#define HTTP_POLL_MS		50

/* Longest URL a destination may have. */
#define HTTP_MAX_URL_LEN	2048

static bool curl_initialized = false;
static CURLM *multi = NULL;

/* Easy handles kept between requests: curl_easy_reset is cheaper than a new one. */
#define HTTP_MAX_SPARE_HANDLES	1024
static CURL *spare_handles[HTTP_MAX_SPARE_HANDLES];
static int	n_spare_handles = 0;

/* One request in flight. */
typedef struct HttpRequest
{
	RelayItem  *item;
	CURL	   *easy;
	struct curl_slist *headers;
	char		errbuf[CURL_ERROR_SIZE];
} HttpRequest;

/* Initialise libcurl once per backend. */
static void
http_init(void)
{
	if (curl_initialized)
		return;
	if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not initialize libcurl")));
	curl_initialized = true;
}

/* The backend's multi handle, created on first use and kept for its connection cache. */
static CURLM *
http_multi(void)
{
	http_init();
	if (multi == NULL)
	{
		multi = curl_multi_init();
		if (multi == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_OUT_OF_MEMORY),
					 errmsg("could not create a libcurl multi handle")));
	}
	curl_multi_setopt(multi, CURLMOPT_MAX_HOST_CONNECTIONS, (long) relay_max_in_flight);
	curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, (long) relay_max_in_flight);
	return multi;
}

/*
 * Why url cannot be a destination, or NULL if it can: an http or https URL
 * that libcurl parses, with a host, without credentials (they would show in
 * the target; headers are the place for them) and without whitespace.
 */
const char *
http_check_url(const char *url)
{
	CURLU	   *u;
	CURLUcode	rc;
	char	   *part = NULL;
	const char *why = NULL;

	if (pg_strncasecmp(url, "http://", 7) != 0 && pg_strncasecmp(url, "https://", 8) != 0)
		return "The URL must start with http:// or https://.";
	if (strlen(url) > HTTP_MAX_URL_LEN)
		return psprintf("The URL must not be longer than %d bytes.", HTTP_MAX_URL_LEN);
	for (const char *p = url; *p; p++)
		if ((unsigned char) *p <= 0x20 || *p == 0x7F)
			return "The URL must not contain spaces or control characters.";

	http_init();
	u = curl_url();
	if (u == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	rc = curl_url_set(u, CURLUPART_URL, url, 0);
	if (rc != CURLUE_OK)
		why = psprintf("libcurl cannot parse it: %s.", curl_url_strerror(rc));
	else if (curl_url_get(u, CURLUPART_USER, &part, 0) == CURLUE_OK)
		why = "The URL must not carry credentials; put them in the \"headers\" option.";
	else if (curl_url_get(u, CURLUPART_HOST, &part, 0) != CURLUE_OK || part[0] == '\0')
		why = "The URL has no host.";
	if (part != NULL)
		curl_free(part);
	curl_url_cleanup(u);
	return why;
}

/* The HMAC key of a validated "whsec_<base64>" secret. */
bytea *
http_decode_secret(const char *secret)
{
	const char *b64 = secret + strlen("whsec_");
	int			len = strlen(b64);
	int			maxlen = pg_b64_dec_len(len);
	bytea	   *key = palloc(VARHDRSZ + maxlen);
	int			n = pg_b64_decode(b64, len, VARDATA(key), maxlen);

	if (n < 0)
		elog(ERROR, "invalid webhook secret in an outbox destination");
	SET_VARSIZE(key, VARHDRSZ + n);
	return key;
}

#if OPENSSL_VERSION_NUMBER >= 0x30000000L
/*
 * HMAC-SHA256 of id.timestamp.body with key into mac (32 bytes); false on
 * failure.  OpenSSL 3's one-shot HMAC() looks the algorithm up and builds a
 * context on every call, which costs more than the MAC of a small webhook:
 * the relay keeps one context for the backend's life and only rekeys it.
 */
static bool
http_hmac(bytea *key, const char *id, const char *timestamp,
		  const char *body, size_t body_len, unsigned char *mac)
{
	static EVP_MAC_CTX *ctx = NULL;
	size_t		maclen = 0;

	if (ctx == NULL)
	{
		EVP_MAC    *hmac = EVP_MAC_fetch(NULL, "HMAC", NULL);
		OSSL_PARAM	params[2];

		if (hmac == NULL)
			return false;
		ctx = EVP_MAC_CTX_new(hmac);
		EVP_MAC_free(hmac);		/* the context keeps its own reference */
		params[0] = OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, "SHA256", 0);
		params[1] = OSSL_PARAM_construct_end();
		if (ctx == NULL || EVP_MAC_CTX_set_params(ctx, params) != 1)
		{
			EVP_MAC_CTX_free(ctx);
			ctx = NULL;
			return false;
		}
	}
	return EVP_MAC_init(ctx, (const unsigned char *) VARDATA(key),
						VARSIZE(key) - VARHDRSZ, NULL) == 1 &&
		EVP_MAC_update(ctx, (const unsigned char *) id, strlen(id)) == 1 &&
		EVP_MAC_update(ctx, (const unsigned char *) ".", 1) == 1 &&
		EVP_MAC_update(ctx, (const unsigned char *) timestamp, strlen(timestamp)) == 1 &&
		EVP_MAC_update(ctx, (const unsigned char *) ".", 1) == 1 &&
		EVP_MAC_update(ctx, (const unsigned char *) body, body_len) == 1 &&
		EVP_MAC_final(ctx, mac, &maclen, EVP_MAX_MD_SIZE) == 1 &&
		maclen == 32;
}
#else
/* HMAC-SHA256 of id.timestamp.body with key into mac (32 bytes); false on failure. */
static bool
http_hmac(bytea *key, const char *id, const char *timestamp,
		  const char *body, size_t body_len, unsigned char *mac)
{
	StringInfoData content;
	unsigned int maclen = 0;
	bool		ok;

	initStringInfo(&content);
	appendStringInfo(&content, "%s.%s.", id, timestamp);
	appendBinaryStringInfo(&content, body, body_len);
	ok = HMAC(EVP_sha256(), VARDATA(key), VARSIZE(key) - VARHDRSZ,
			  (const unsigned char *) content.data, content.len,
			  mac, &maclen) != NULL && maclen == 32;
	pfree(content.data);
	return ok;
}
#endif

/* The webhook-signature header: "v1,<sig>" per secret, space-separated. */
static char *
http_signature(RelayDest *d, const char *id, const char *timestamp,
			   const char *body, size_t body_len)
{
	StringInfoData header;
	ListCell   *lc;

	initStringInfo(&header);
	appendStringInfoString(&header, "webhook-signature: ");
	foreach(lc, d->secrets)
	{
		bytea	   *key = lfirst(lc);
		unsigned char mac[EVP_MAX_MD_SIZE];
		char		b64[128];
		int			b64len;

		if (!http_hmac(key, id, timestamp, body, body_len, mac))
			ereport(ERROR,
					(errcode(ERRCODE_INTERNAL_ERROR),
					 errmsg("could not compute a webhook signature")));
		b64len = pg_b64_encode((const char *) mac, 32, b64, sizeof(b64));
		if (b64len < 0)
			elog(ERROR, "could not encode a webhook signature");
		if (lc != list_head(d->secrets))
			appendStringInfoChar(&header, ' ');
		appendStringInfo(&header, "v1,%.*s", b64len, b64);
	}
	return header.data;
}

/* Whether the destination's own headers set name (case-insensitive). */
static bool
http_dest_has_header(RelayDest *d, const char *name, int len)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;

	if (d->headers == NULL)
		return false;
	it = JsonbIteratorInit(&d->headers->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
		if (tok == WJB_KEY && v.val.string.len == len &&
			pg_strncasecmp(v.val.string.val, name, len) == 0)
			return true;
	return false;
}

/* Append "name: value" for every pair of a validated headers object, unless skip says no. */
static struct curl_slist *
http_append_headers(struct curl_slist *list, Jsonb *headers, RelayDest *skip_if_in)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;
	char	   *name = NULL;
	int			namelen = 0;

	if (headers == NULL)
		return list;
	it = JsonbIteratorInit(&headers->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		if (tok == WJB_KEY)
		{
			name = v.val.string.val;
			namelen = v.val.string.len;
		}
		else if (tok == WJB_VALUE && v.type == jbvString &&
				 (skip_if_in == NULL || !http_dest_has_header(skip_if_in, name, namelen)))
		{
			char	   *line = psprintf("%.*s: %.*s", namelen, name,
										v.val.string.len, v.val.string.val);

			list = curl_slist_append(list, line);
			pfree(line);
		}
	}
	return list;
}

/* Discard the response body: only the status matters. */
static size_t
http_discard(char *ptr, size_t size, size_t nmemb, void *userdata)
{
	return size * nmemb;
}

/* Start one request on the multi handle. */
static void
http_start(CURLM *m, HttpRequest *req)
{
	RelayItem  *it = req->item;
	RelayDest  *d = it->dest;
	char	   *id = DatumGetCString(DirectFunctionCall1(uuid_out,
														 UUIDPGetDatum(&it->event_id)));
	char		timestamp[32];
	size_t		body_len = strlen(it->body);
	struct curl_slist *h = NULL;
	char	   *signature;
	char	   *id_line;
	char	   *ts_line;
	CURL	   *e;

	snprintf(timestamp, sizeof(timestamp), INT64_FORMAT,
			 (int64) (GetCurrentTimestamp() / USECS_PER_SEC +
					  (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY));

	/* Everything that can fail before the list exists, so no list is lost. */
	signature = http_signature(d, id, timestamp, it->body, body_len);
	id_line = psprintf("webhook-id: %s", id);
	ts_line = psprintf("webhook-timestamp: %s", timestamp);

	h = curl_slist_append(h, "Content-Type: application/json");
	/* No "Expect: 100-continue" round trip for large bodies. */
	h = curl_slist_append(h, "Expect:");
	h = curl_slist_append(h, id_line);
	h = curl_slist_append(h, ts_line);
	h = curl_slist_append(h, signature);
	h = http_append_headers(h, d->headers, NULL);
	h = http_append_headers(h, it->event_headers, d);
	req->headers = h;
	if (h == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));

	if (n_spare_handles > 0)
	{
		e = spare_handles[--n_spare_handles];
		curl_easy_reset(e);
	}
	else
		e = curl_easy_init();
	if (e == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("could not create a libcurl handle")));
	req->easy = e;
	req->errbuf[0] = '\0';
	it->sent = true;
	curl_easy_setopt(e, CURLOPT_URL, d->target);
	curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
	curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
	curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e, CURLOPT_POST, 1L);
	curl_easy_setopt(e, CURLOPT_POSTFIELDS, it->body);
	curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t) body_len);
	curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
	curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long) d->timeout_ms);
	curl_easy_setopt(e, CURLOPT_USERAGENT, "idempotency-relay/1.1");
	curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, http_discard);
	curl_easy_setopt(e, CURLOPT_ERRORBUFFER, req->errbuf);
	curl_easy_setopt(e, CURLOPT_PRIVATE, req);
	if (curl_multi_add_handle(m, e) != CURLM_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not start an HTTP request")));
}

/* Take a finished request off the multi handle; keep its handle for the next one. */
static void
http_finish(CURLM *m, HttpRequest *req)
{
	if (req->easy != NULL)
	{
		curl_multi_remove_handle(m, req->easy);
		if (n_spare_handles < HTTP_MAX_SPARE_HANDLES)
			spare_handles[n_spare_handles++] = req->easy;
		else
			curl_easy_cleanup(req->easy);
		req->easy = NULL;
	}
	if (req->headers != NULL)
	{
		curl_slist_free_all(req->headers);
		req->headers = NULL;
	}
}

/* Record what a finished request means for its delivery. */
static void
http_outcome(HttpRequest *req, CURLcode result)
{
	RelayItem  *it = req->item;
	long		status = 0;

	it->finished_at = GetCurrentTimestamp();
	if (result != CURLE_OK)
	{
		it->outcome = RELAY_FAILED;
		it->error = psprintf("%s", req->errbuf[0] ? req->errbuf : curl_easy_strerror(result));
		return;
	}
	curl_easy_getinfo(req->easy, CURLINFO_RESPONSE_CODE, &status);
	it->status = (int32) status;
	if (status >= 200 && status < 300)
		it->outcome = RELAY_DELIVERED;
	else
	{
		it->outcome = RELAY_FAILED;
		it->error = psprintf("HTTP status %ld", status);
		if (status == 410 && it->dest->disable_reason == NULL)
			it->dest->disable_reason = "the endpoint answered 410 Gone";
	}
}

/*
 * Deliver every pending item of kind 'http' in items, at most
 * idempotency.relay_max_in_flight at a time, and set each one's outcome.
 * The deliveries of one key to one destination go one after the other: each
 * starts when its predecessor is delivered, and is released (not sent) if
 * the predecessor fails.  While requests are under way, the pass's claims
 * are renewed when lease says so; a delivery that is no longer ours by then
 * is not sent.  Allocates in the current memory context (the pass's).
 */
void
http_deliver(RelayItem **items, int nitems, RelayLease *lease)
{
	CURLM	   *m = http_multi();
	HttpRequest *reqs = palloc0(sizeof(HttpRequest) * nitems);
	int		   *ready = palloc(sizeof(int) * nitems);	/* queue of requests */
	int			nreqs = 0;
	int			ready_head = 0;
	int			ready_tail = 0;
	int			in_flight = 0;

	for (int i = 0; i < nitems; i++)
	{
		if (items[i]->outcome == RELAY_PENDING && items[i]->dest->kind == DEST_HTTP)
		{
			items[i]->http_slot = nreqs;
			reqs[nreqs].item = items[i];
			if (!items[i]->chain_held)
				ready[ready_tail++] = nreqs;
			nreqs++;
		}
	}

	PG_TRY();
	{
		while (ready_head < ready_tail || in_flight > 0)
		{
			int			running;
			CURLMsg    *msg;
			int			left;

			/* A long pass: keep its claims hidden from other relays. */
			if (lease->renewable && GetCurrentTimestamp() >= lease->renew_at)
				relay_renew_claims(items, nitems, lease);

			while (in_flight < relay_max_in_flight && ready_head < ready_tail)
			{
				HttpRequest *req = &reqs[ready[ready_head++]];

				/* Taken over after all (see relay_renew_claims): not ours to send. */
				if (req->item->outcome != RELAY_PENDING)
					continue;
				http_start(m, req);
				in_flight++;
			}

			if (curl_multi_perform(m, &running) != CURLM_OK)
				ereport(ERROR,
						(errcode(ERRCODE_INTERNAL_ERROR),
						 errmsg("libcurl failed while sending webhooks")));
			while ((msg = curl_multi_info_read(m, &left)) != NULL)
			{
				HttpRequest *req;
				RelayItem  *next;

				if (msg->msg != CURLMSG_DONE)
					continue;
				curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **) &req);
				http_outcome(req, msg->data.result);
				http_finish(m, req);
				in_flight--;

				/* The next delivery of the key may go now, or never. */
				next = req->item->chain_next;
				if (req->item->outcome != RELAY_DELIVERED)
					relay_release_chain(req->item);
				else if (next != NULL && next->outcome == RELAY_PENDING)
					ready[ready_tail++] = next->http_slot;
			}
			if (in_flight > 0 &&
				(ready_head >= ready_tail || in_flight >= relay_max_in_flight))
			{
				int			numfds;

				if (curl_multi_poll(m, NULL, 0, HTTP_POLL_MS, &numfds) != CURLM_OK)
					ereport(ERROR,
							(errcode(ERRCODE_INTERNAL_ERROR),
							 errmsg("libcurl failed while waiting for webhooks")));
			}
			CHECK_FOR_INTERRUPTS();
		}
	}
	PG_CATCH();
	{
		/* Abandon what is in flight; the multi handle stays usable. */
		for (int i = 0; i < nreqs; i++)
			http_finish(m, &reqs[i]);
		PG_RE_THROW();
	}
	PG_END_TRY();
	pfree(reqs);
	pfree(ready);
}

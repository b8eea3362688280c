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
 * The relay only connects to public addresses, unless
 * idempotency.relay_allowed_networks lists the address: no destination,
 * whoever created it, can make the server post to itself, its private
 * network or a cloud metadata service and read the answer back from the
 * dead letters.  The address is checked when libcurl opens the socket,
 * after name resolution (CURLOPT_OPENSOCKETFUNCTION), so that a name that
 * resolves to a private address is refused too, whatever DNS answers;
 * libcurl is told to ignore proxy settings of the environment, so that it
 * connects to the address it checked.  idem_destination_create refuses
 * early a URL whose host is a forbidden address literal or localhost.
 *
 * Every socket libcurl opens for the relay is reported to PostgreSQL's file
 * descriptor accounting (AcquireExternalFD when it opens, ReleaseExternalFD
 * when it closes), which lets a backend's external descriptors take up to a
 * third of max_safe_fds; the relay keeps no more requests in flight, nor
 * connections alive, than that share (http_max_in_flight).
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

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <curl/curl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
#include <openssl/core_names.h>
#endif

#include "common/base64.h"
#include "lib/ilist.h"
#include "miscadmin.h"
#include "storage/fd.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/uuid.h"
#include "utils/varlena.h"

#include "compat.h"
#include "outbox.h"
#include "relay_http.h"

/* How long one wait for network activity lasts before interrupts are checked. */
#define HTTP_POLL_MS		50

/* Longest URL a destination may have. */
#define HTTP_MAX_URL_LEN	2048

static bool curl_initialized = false;
static CURLM *multi = NULL;

/* A network of idempotency.relay_allowed_networks. */
typedef struct HttpNetwork
{
	int			family;			/* AF_INET or AF_INET6 */
	int			bits;			/* prefix length */
	unsigned char addr[16];		/* network byte order */
} HttpNetwork;

/* The parsed setting: the check hook's "extra". */
typedef struct HttpAllowlist
{
	int			n;
	HttpNetwork nets[FLEXIBLE_ARRAY_MEMBER];
} HttpAllowlist;

static HttpAllowlist *http_allowlist = NULL;

/*
 * Changed whenever the setting changes: a connection kept alive from before
 * may lead to an address no longer allowed, so the multi handle and its
 * connection cache are replaced.
 */
static uint64 http_allowlist_generation = 0;
static uint64 multi_generation = 0;

/* Easy handles kept between requests: curl_easy_reset is cheaper than a new one. */
#define HTTP_MAX_SPARE_HANDLES	1024
static CURL *spare_handles[HTTP_MAX_SPARE_HANDLES];
static int	n_spare_handles = 0;

/* One request in flight. */
typedef struct HttpRequest
{
	dlist_node	node;			/* in async_requests, for the relay loop's requests */
	RelayItem  *item;
	CURL	   *easy;
	struct curl_slist *headers;
	char		errbuf[CURL_ERROR_SIZE];
	char		refusal[256];	/* why a connection was refused, or "" */
	bool		no_fd;			/* refused: no file descriptor to spare */
	bool		retried_fd;		/* retried once after closing idle connections */
	bool		headers_ended;	/* the last response's header block was complete */
	MemoryContext cxt;			/* the loop's requests: where their outcome goes */
} HttpRequest;

/*
 * The relay loop's requests (http_async_*): on the multi handle, and
 * waiting for a file descriptor; async_in_flight counts both.
 */
static dlist_head async_requests = DLIST_STATIC_INIT(async_requests);
static dlist_head async_waiting = DLIST_STATIC_INIT(async_waiting);
static int	async_in_flight = 0;
static MemoryContext async_cxt = NULL;

/* http_async_kick saw requests complete: their outcomes wait for collecting. */
static bool async_news = false;

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

/* Close the backend's multi handle and every connection it keeps alive. */
static void
http_multi_close(void)
{
	if (multi == NULL)
		return;
	curl_multi_cleanup(multi);
	multi = NULL;
	/* Its wake-up socket pair. */
	ReleaseExternalFD();
	ReleaseExternalFD();
}

/* The backend's multi handle, created on first use and kept for its connection cache. */
static CURLM *
http_multi(void)
{
	http_init();
	/* Connections made under another allowlist: close them all. */
	if (multi != NULL && multi_generation != http_allowlist_generation &&
		dlist_is_empty(&async_requests))
		http_multi_close();
	if (multi == NULL)
	{
		multi_generation = http_allowlist_generation;
		multi = curl_multi_init();
		if (multi == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_OUT_OF_MEMORY),
					 errmsg("could not create a libcurl multi handle")));
		/* Its wake-up socket pair. */
		ReserveExternalFD();
		ReserveExternalFD();
	}
	curl_multi_setopt(multi, CURLMOPT_MAX_HOST_CONNECTIONS, (long) http_max_in_flight());
	curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, (long) http_max_in_flight());
	return multi;
}

/*
 * How many requests the relay has in flight at most, and connections kept
 * alive: idempotency.relay_max_in_flight, but no more than the file
 * descriptors PostgreSQL lets this backend hold besides its own files (a
 * third of max_safe_fds, as AcquireExternalFD allows), less the multi
 * handle's wake-up pair and the descriptor of the relay loop's wait
 * (http_async_wait).
 */
int
http_max_in_flight(void)
{
	return Max(1, Min(relay_max_in_flight, max_safe_fds / 3 - 3));
}

/*
 * What kind of non-public IPv4 address a (4 bytes, network order) is, or
 * NULL for a public one: the special-purpose ranges of RFC 6890 and its
 * updates, which an outside webhook endpoint never has.
 */
static const char *
http_ipv4_kind(const unsigned char *a)
{
	static const struct
	{
		uint32		net;
		int			bits;
		const char *kind;
	}			special[] = {
		{0x00000000, 8, "a \"this network\" address (0.0.0.0/8)"},
		{0x0A000000, 8, "a private address (10.0.0.0/8)"},
		{0x64400000, 10, "a shared address (100.64.0.0/10)"},
		{0x7F000000, 8, "a loopback address (127.0.0.0/8)"},
		{0xA9FE0000, 16, "a link-local address (169.254.0.0/16)"},
		{0xAC100000, 12, "a private address (172.16.0.0/12)"},
		{0xC0000000, 24, "an IETF protocol address (192.0.0.0/24)"},
		{0xC0000200, 24, "a documentation address (192.0.2.0/24)"},
		{0xC0586300, 24, "a 6to4 relay address (192.88.99.0/24)"},
		{0xC0A80000, 16, "a private address (192.168.0.0/16)"},
		{0xC6120000, 15, "a benchmarking address (198.18.0.0/15)"},
		{0xC6336400, 24, "a documentation address (198.51.100.0/24)"},
		{0xCB007100, 24, "a documentation address (203.0.113.0/24)"},
		{0xE0000000, 4, "a multicast address (224.0.0.0/4)"},
		{0xF0000000, 4, "a reserved address (240.0.0.0/4)"},
	};
	uint32		v = ((uint32) a[0] << 24) | ((uint32) a[1] << 16) |
		((uint32) a[2] << 8) | (uint32) a[3];

	for (int i = 0; i < lengthof(special); i++)
		if ((v >> (32 - special[i].bits)) == (special[i].net >> (32 - special[i].bits)))
			return special[i].kind;
	return NULL;
}

/* Whether the first bits of a and b (network order) are the same. */
static bool
http_prefix_equal(const unsigned char *a, const unsigned char *b, int bits)
{
	int			bytes = bits / 8;
	int			rest = bits % 8;

	if (memcmp(a, b, bytes) != 0)
		return false;
	if (rest == 0)
		return true;
	return ((a[bytes] ^ b[bytes]) & (0xFF << (8 - rest))) == 0;
}

/*
 * What kind of non-public IPv6 address a (16 bytes) is, or NULL: only
 * global unicast (2000::/3) is public, less its special-purpose ranges.
 * Callers have turned IPv4-mapped and NAT64 addresses into IPv4 ones.
 */
static const char *
http_ipv6_kind(const unsigned char *a)
{
	static const struct
	{
		unsigned char net[4];
		int			bits;
		const char *kind;
	}			special[] = {
		{{0x20, 0x01, 0x0d, 0xb8}, 32, "a documentation address (2001:db8::/32)"},
		{{0x20, 0x01, 0x00, 0x00}, 23, "an IETF protocol address (2001::/23)"},
		{{0x20, 0x02, 0x00, 0x00}, 16, "a 6to4 address (2002::/16)"},
		{{0xfc, 0x00, 0x00, 0x00}, 7, "a unique local address (fc00::/7)"},
		{{0xfe, 0x80, 0x00, 0x00}, 10, "a link-local address (fe80::/10)"},
		{{0xfe, 0xc0, 0x00, 0x00}, 10, "a site-local address (fec0::/10)"},
		{{0xff, 0x00, 0x00, 0x00}, 8, "a multicast address (ff00::/8)"},
	};
	static const unsigned char loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
	static const unsigned char unspecified[16] = {0};

	if (memcmp(a, loopback, 16) == 0)
		return "a loopback address (::1)";
	if (memcmp(a, unspecified, 16) == 0)
		return "the unspecified address (::)";
	for (int i = 0; i < lengthof(special); i++)
		if (http_prefix_equal(a, special[i].net, special[i].bits))
			return special[i].kind;
	if ((a[0] & 0xE0) != 0x20)
		return "not a global unicast address (2000::/3)";
	return NULL;
}

/*
 * An address as the checks see it: family and bytes, with IPv4-mapped
 * (::ffff:0:0/96) and NAT64 (64:ff9b::/96) addresses turned into the IPv4
 * address they lead to.  False for a family other than IPv4 and IPv6.
 */
static bool
http_address_bytes(const struct sockaddr *sa, int *family, unsigned char *bytes)
{
	static const unsigned char v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	static const unsigned char nat64[12] = {0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0};

	if (sa->sa_family == AF_INET)
	{
		*family = AF_INET;
		memcpy(bytes, &((const struct sockaddr_in *) sa)->sin_addr, 4);
		return true;
	}
	if (sa->sa_family == AF_INET6)
	{
		const unsigned char *a = (const unsigned char *) &((const struct sockaddr_in6 *) sa)->sin6_addr;

		if (memcmp(a, v4mapped, 12) == 0 || memcmp(a, nat64, 12) == 0)
		{
			*family = AF_INET;
			memcpy(bytes, a + 12, 4);
		}
		else
		{
			*family = AF_INET6;
			memcpy(bytes, a, 16);
		}
		return true;
	}
	return false;
}

/*
 * Why the relay may not connect to sa, or NULL if it may: a public
 * address, or one in idempotency.relay_allowed_networks.  Runs inside
 * libcurl's calls: it must not raise an error or allocate.
 */
static const char *
http_address_refusal(const struct sockaddr *sa)
{
	int			family;
	unsigned char bytes[16];
	const char *kind;

	if (!http_address_bytes(sa, &family, bytes))
		return "not an IP address";
	kind = (family == AF_INET) ? http_ipv4_kind(bytes) : http_ipv6_kind(bytes);
	if (kind == NULL)
		return NULL;
	if (http_allowlist != NULL)
		for (int i = 0; i < http_allowlist->n; i++)
		{
			const HttpNetwork *net = &http_allowlist->nets[i];

			if (net->family == family && http_prefix_equal(bytes, net->addr, net->bits))
				return NULL;
		}
	return kind;
}

/*
 * libcurl's CURLOPT_OPENSOCKETFUNCTION: open a socket to a resolved
 * address only if the relay may connect there; else note why in the
 * request and refuse (libcurl then fails the transfer, or tries the
 * host's next address).
 */
static curl_socket_t
http_open_socket(void *clientp, curlsocktype purpose, struct curl_sockaddr *address)
{
	HttpRequest *req = clientp;
	const char *why = http_address_refusal(&address->addr);
	curl_socket_t sock;

	if (why != NULL)
	{
		if (req->refusal[0] == '\0')
		{
			char		text[INET6_ADDRSTRLEN] = "?";
			const void *a = (address->family == AF_INET6) ?
				(const void *) &((struct sockaddr_in6 *) &address->addr)->sin6_addr :
				(const void *) &((struct sockaddr_in *) &address->addr)->sin_addr;

			(void) inet_ntop(address->family, a, text, sizeof(text));
			snprintf(req->refusal, sizeof(req->refusal),
					 "refused to connect to %s: %s, not listed in idempotency.relay_allowed_networks",
					 text, why);
		}
		return CURL_SOCKET_BAD;
	}
	/* A descriptor PostgreSQL must know of: it may not have one to spare. */
	if (!AcquireExternalFD())
	{
		req->no_fd = true;
		if (req->refusal[0] == '\0')
			snprintf(req->refusal, sizeof(req->refusal),
					 "no file descriptor to spare for a connection in this server process (max_files_per_process)");
		return CURL_SOCKET_BAD;
	}
	sock = socket(address->family, address->socktype, address->protocol);
	if (sock == CURL_SOCKET_BAD)
		ReleaseExternalFD();
	return sock;
}

/*
 * libcurl's CURLOPT_CLOSESOCKETFUNCTION, for the sockets http_open_socket
 * opened (also those of connections kept alive): close it and tell
 * PostgreSQL's accounting.
 */
static int
http_close_socket(void *clientp, curl_socket_t sock)
{
	int			rc = close(sock);

	ReleaseExternalFD();
	return rc;
}

/* Check hook of idempotency.relay_allowed_networks: IP addresses and CIDR networks. */
bool
http_check_allowed_networks(char **newval, void **extra, GucSource source)
{
	char	   *raw = pstrdup(*newval);
	List	   *items;
	ListCell   *lc;
	HttpAllowlist *list;
	int			n = 0;

	if (!SplitGUCList(raw, ',', &items))
	{
		GUC_check_errdetail("List syntax is invalid.");
		return false;
	}
	/* The GUC machinery frees "extra" itself: allocate it its way. */
	list = guc_malloc(LOG, offsetof(HttpAllowlist, nets) +
					  sizeof(HttpNetwork) * Max(list_length(items), 1));
	if (list == NULL)
		return false;
	foreach(lc, items)
	{
		char	   *item = lfirst(lc);
		char	   *slash = strchr(item, '/');
		HttpNetwork *net = &list->nets[n];
		int			maxbits;

		if (slash != NULL)
			*slash = '\0';
		memset(net, 0, sizeof(*net));
		if (inet_pton(AF_INET, item, net->addr) == 1)
			net->family = AF_INET;
		else if (inet_pton(AF_INET6, item, net->addr) == 1)
			net->family = AF_INET6;
		else
		{
			GUC_check_errdetail("\"%s\" is not an IP address.", item);
			GUC_check_errhint("List IP addresses or networks such as 127.0.0.1, 10.0.0.0/8 or fd00::/8; names are not accepted, since the relay checks the address a name resolves to.");
			guc_free(list);
			return false;
		}
		maxbits = (net->family == AF_INET) ? 32 : 128;
		net->bits = maxbits;
		if (slash != NULL)
		{
			char	   *end;
			long		bits = strtol(slash + 1, &end, 10);

			if (slash[1] == '\0' || *end != '\0' || bits < 0 || bits > maxbits)
			{
				GUC_check_errdetail("\"%s/%s\" has an invalid prefix length: it must be 0 to %d.",
									item, slash + 1, maxbits);
				guc_free(list);
				return false;
			}
			net->bits = (int) bits;
		}
		n++;
	}
	list->n = n;
	*extra = list;
	list_free(items);
	pfree(raw);
	return true;
}

/* Assign hook of idempotency.relay_allowed_networks. */
void
http_assign_allowed_networks(const char *newval, void *extra)
{
	http_allowlist = (HttpAllowlist *) extra;
	http_allowlist_generation++;
}

/*
 * Why the host of a valid http(s) URL may not be a destination's, or
 * NULL: an address literal the relay would refuse to connect to, or a name
 * that means loopback by definition (localhost, *.localhost).  Other names
 * are checked when the relay connects, after they are resolved.
 */
const char *
http_check_url_host(const char *url)
{
	CURLU	   *u;
	char	   *part = NULL;
	char	   *host;
	size_t		len;
	struct sockaddr_storage ss;
	const char *why = NULL;

	http_init();
	u = curl_url();
	if (u == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK ||
		curl_url_get(u, CURLUPART_HOST, &part, 0) != CURLUE_OK)
	{
		curl_url_cleanup(u);
		return NULL;			/* http_check_url has said why */
	}
	host = pstrdup(part);
	curl_free(part);
	curl_url_cleanup(u);

	/* "[v6]" to "v6"; one trailing dot (a fully qualified name) dropped. */
	len = strlen(host);
	if (len >= 2 && host[0] == '[' && host[len - 1] == ']')
	{
		host[len - 1] = '\0';
		host++;
	}
	else if (len > 1 && host[len - 1] == '.')
		host[len - 1] = '\0';

	memset(&ss, 0, sizeof(ss));
	if (inet_pton(AF_INET, host, &((struct sockaddr_in *) &ss)->sin_addr) == 1)
		ss.ss_family = AF_INET;
	else if (inet_pton(AF_INET6, host, &((struct sockaddr_in6 *) &ss)->sin6_addr) == 1)
		ss.ss_family = AF_INET6;
	else if (pg_strcasecmp(host, "localhost") == 0 ||
			 (strlen(host) > 10 &&
			  pg_strcasecmp(host + strlen(host) - 10, ".localhost") == 0))
	{
		/* It resolves to 127.0.0.1 (and ::1). */
		ss.ss_family = AF_INET;
		((struct sockaddr_in *) &ss)->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	}
	else
		return NULL;

	why = http_address_refusal((struct sockaddr *) &ss);
	if (why == NULL)
		return NULL;
	return psprintf("The host %s is %s.", host, why);
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
	int			n = pg_b64_decode(b64, len, (uint8 *) VARDATA(key), maxlen);

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
		b64len = pg_b64_encode(mac, 32, b64, sizeof(b64));
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

/*
 * Follow the answer's header blocks: a status line opens one, an empty line
 * closes it.  libcurl reports an answer cut off inside its headers as a
 * complete transfer, with the status it read; http_outcome must not take
 * that for a 2xx.
 */
static size_t
http_header_seen(char *line, size_t size, size_t nitems, void *userdata)
{
	HttpRequest *req = (HttpRequest *) userdata;
	size_t		len = size * nitems;

	if (len >= 5 && memcmp(line, "HTTP/", 5) == 0)
		req->headers_ended = false;
	else if ((len == 2 && line[0] == '\r' && line[1] == '\n') ||
			 (len == 1 && line[0] == '\n'))
		req->headers_ended = true;
	return len;
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
	req->refusal[0] = '\0';
	req->no_fd = false;
	req->headers_ended = false;
	it->sent = true;
	curl_easy_setopt(e, CURLOPT_URL, d->target);
	curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
	/* Connect only where http_open_socket allows, and directly. */
	curl_easy_setopt(e, CURLOPT_OPENSOCKETFUNCTION, http_open_socket);
	curl_easy_setopt(e, CURLOPT_OPENSOCKETDATA, req);
	curl_easy_setopt(e, CURLOPT_CLOSESOCKETFUNCTION, http_close_socket);
	curl_easy_setopt(e, CURLOPT_CLOSESOCKETDATA, NULL);
	curl_easy_setopt(e, CURLOPT_PROXY, "");
	curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
	curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e, CURLOPT_POST, 1L);
	curl_easy_setopt(e, CURLOPT_POSTFIELDS, it->body);
	curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t) body_len);
	curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
	curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long) d->timeout_ms);
	/* Connecting has a shorter limit of its own, within the total. */
	curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long) Min(d->connect_timeout_ms, d->timeout_ms));
	curl_easy_setopt(e, CURLOPT_USERAGENT, "idempotency-relay/1.3");
	curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, http_discard);
	curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, http_header_seen);
	curl_easy_setopt(e, CURLOPT_HEADERDATA, req);
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

/*
 * The delay a 429 or 503 answer asks for with Retry-After, in milliseconds,
 * or -1 if it has none that parses or asks for no wait: delta-seconds (a
 * number too large for a long long asks for the longest wait), or an
 * HTTP-date (which curl_getdate reads).  "0", or a date not in the future,
 * counts as no Retry-After at all: honoured, it would have the relay retry
 * at once and forever (a 429 uses up no attempt), hammering the endpoint;
 * so the delivery takes the path of an answer without one instead (the
 * backoff growing with its claims for a 429, an ordinary failure for a
 * 503).  Over a year is as good as the cap: it is clamped to one.
 */
static int64
http_retry_after_ms(CURL *easy)
{
	struct curl_header *h = NULL;
	const char *v;
	char	   *end;
	long long	secs;
	time_t		when;

	if (curl_easy_header(easy, "Retry-After", 0, CURLH_HEADER, -1, &h) != CURLHE_OK ||
		h == NULL || h->value == NULL)
		return -1;
	v = h->value;
	while (*v == ' ' || *v == '\t')
		v++;
	if (*v >= '0' && *v <= '9')
	{
		errno = 0;
		secs = strtoll(v, &end, 10);
		while (*end == ' ' || *end == '\t')
			end++;
		if (*end != '\0' || (errno != 0 && errno != ERANGE))
			return -1;
		/* All digits, too many for a number: the longest wait (ERANGE). */
	}
	else
	{
		when = curl_getdate(v, NULL);
		if (when == (time_t) -1)
			return -1;
		secs = (long long) when - (long long) time(NULL);
	}
	/* No wait asked for: as if there were no Retry-After. */
	if (secs <= 0)
		return -1;
	/* Over a year is as good as the cap. */
	return Min(secs, 366LL * 86400) * 1000;
}

/* Record what a finished request means for its delivery. */
static void
http_outcome(HttpRequest *req, CURLcode result)
{
	RelayItem  *it = req->item;
	long		status = 0;

	it->finished_at = GetCurrentTimestamp();
	it->retry_after_ms = -1;
	if (result != CURLE_OK)
	{
		it->outcome = RELAY_FAILED;
		if (req->refusal[0] != '\0')
			it->error = pstrdup(req->refusal);
		else
			it->error = psprintf("%s", req->errbuf[0] ? req->errbuf : curl_easy_strerror(result));
		return;
	}
	curl_easy_getinfo(req->easy, CURLINFO_RESPONSE_CODE, &status);
	it->status = (int32) status;
	if (!req->headers_ended)
	{
		/* Cut off: whatever its status line said, it is no answer. */
		it->outcome = RELAY_FAILED;
		it->error = psprintf("the answer (HTTP status %ld) ended inside its headers", status);
		return;
	}
	if (status >= 200 && status < 300)
		it->outcome = RELAY_DELIVERED;
	else
	{
		it->outcome = RELAY_FAILED;
		it->error = psprintf("HTTP status %ld", status);
		if (status == 410 && it->dest->disable_reason == NULL)
			it->dest->disable_reason = "the endpoint answered 410 Gone";
		if (status == 429 || status == 503)
			it->retry_after_ms = http_retry_after_ms(req->easy);
	}
}

/*
 * Deliver every pending item of kind 'http' in items, at most
 * http_max_in_flight() at a time and at most its destination's
 * max_in_flight to one destination, and set each one's outcome.  This is
 * the synchronous delivery of a relay pass (idem_outbox_relay(), and the
 * test module's harness); the worker's relay loop uses http_async_* instead.
 * The deliveries of one key to one destination go one after the other: each
 * starts when its predecessor is delivered, and is released (not sent) if
 * the predecessor fails.  While requests are under way, the pass's claims
 * are renewed when lease says so; a delivery that is no longer ours by then
 * is not sent.  A request that finds no file descriptor to spare for a new
 * connection waits for one to come free, and the pass keeps fewer in
 * flight; with none in flight, the idle connections are closed first.
 * Allocates in the current memory context (the pass's).
 */
void
http_deliver(RelayItem **items, int nitems, RelayLease *lease)
{
	CURLM	   *m = http_multi();
	HttpRequest *reqs = palloc0(sizeof(HttpRequest) * nitems);
	int		   *ready = palloc(sizeof(int) * nitems);	/* a ring of requests to start */
	int			ready_head = 0;
	int			ready_len = 0;
	int			nreqs = 0;
	int			in_flight = 0;
	int			max_in_flight = http_max_in_flight();
	bool		closed_idle = false;

#define READY_PUSH(slot) (ready[(ready_head + ready_len++) % nitems] = (slot))

	for (int i = 0; i < nitems; i++)
	{
		if (items[i]->outcome == RELAY_PENDING && items[i]->dest->kind == DEST_HTTP)
		{
			items[i]->http_slot = nreqs;
			reqs[nreqs].item = items[i];
			if (!items[i]->chain_held)
				READY_PUSH(nreqs);
			nreqs++;
		}
	}

	PG_TRY();
	{
		while (ready_len > 0 || in_flight > 0)
		{
			int			running;
			CURLMsg    *msg;
			int			left;
			bool		close_idle = false;

			/* A long pass: keep its claims hidden from other relays. */
			if (lease->renewable && GetCurrentTimestamp() >= lease->renew_at)
				relay_renew_claims(items, nitems, lease);

			/*
			 * Start what may go, each destination within its max_in_flight:
			 * a request to a destination at its limit goes back to the end
			 * of the ring (each is looked at once per round).
			 */
			for (int looked = ready_len; looked > 0 && in_flight < max_in_flight && ready_len > 0; looked--)
			{
				HttpRequest *req = &reqs[ready[ready_head++ % nitems]];

				ready_len--;
				/* Taken over after all (see relay_renew_claims): not ours to send. */
				if (req->item->outcome != RELAY_PENDING)
					continue;
				if (req->item->dest->in_flight >= req->item->dest->max_in_flight)
				{
					READY_PUSH(req->item->http_slot);
					continue;
				}
				http_start(m, req);
				req->item->dest->in_flight++;
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
				in_flight--;
				req->item->dest->in_flight--;

				/* No descriptor for a new connection: try again once one is free. */
				if (req->no_fd && msg->data.result != CURLE_OK &&
					(in_flight > 0 || !closed_idle))
				{
					if (in_flight > 0)
						max_in_flight = Max(in_flight, 1);
					else
						close_idle = true;
					http_finish(m, req);
					req->item->sent = false;
					READY_PUSH(req->item->http_slot);
					continue;
				}

				http_outcome(req, msg->data.result);
				http_finish(m, req);

				/* The next delivery of the key may go now, or never. */
				next = req->item->chain_next;
				if (req->item->outcome != RELAY_DELIVERED)
					relay_release_chain(req->item);
				else if (next != NULL && next->outcome == RELAY_PENDING)
					READY_PUSH(next->http_slot);
			}
			if (close_idle && in_flight == 0)
			{
				/* Idle connections (to other hosts, say) hold descriptors. */
				http_multi_close();
				m = http_multi();
				closed_idle = true;
			}
			if (in_flight > 0)
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
			http_finish(multi, &reqs[i]);
		PG_RE_THROW();
	}
	PG_END_TRY();
#undef READY_PUSH
	pfree(reqs);
	pfree(ready);
}

/*
 * The relay loop's requests (http_async_*).  The worker's relay never waits
 * for a whole batch: its requests stay in flight on the backend's multi
 * handle from one iteration of its loop to the next, and each iteration
 * collects those that completed.  A request that found no file descriptor
 * to spare waits in async_waiting until another completes.
 */

/* Put a request on the multi handle, its strings in its delivery's batch. */
static void
http_async_launch(HttpRequest *req)
{
	MemoryContext old = MemoryContextSwitchTo(req->cxt);

	http_start(http_multi(), req);
	MemoryContextSwitchTo(old);
	dlist_push_tail(&async_requests, &req->node);
}

/*
 * Start the request of one claimed 'http' delivery, and return at once; its
 * outcome comes back from http_async_collect.  Allocates the request's
 * strings, and later its outcome's, in the current memory context (the
 * delivery's batch).
 */
void
http_async_start(RelayItem *it)
{
	HttpRequest *req;

	if (async_cxt == NULL)
		async_cxt = AllocSetContextCreate(TopMemoryContext, "outbox relay requests",
										  ALLOCSET_SMALL_SIZES);
	req = MemoryContextAllocZero(async_cxt, sizeof(HttpRequest));
	req->item = it;
	req->cxt = CurrentMemoryContext;
	http_async_launch(req);
	async_in_flight++;
}

/*
 * Let libcurl send the requests just started, so that they are under way
 * while the loop does its database work; their outcomes come back from
 * http_async_collect.  Never waits.
 */
void
http_async_kick(void)
{
	int			running;
	int			on_multi = 0;
	dlist_iter	iter;

	if (dlist_is_empty(&async_requests))
		return;
	if (curl_multi_perform(http_multi(), &running) != CURLM_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("libcurl failed while sending webhooks")));
	dlist_foreach(iter, &async_requests)
		on_multi++;
	/* Some completed meanwhile: http_async_wait must not sleep before they are collected. */
	if (running < on_multi)
		async_news = true;
}

/* Requests of the relay loop in flight (or waiting for a descriptor). */
int
http_async_in_flight(void)
{
	return async_in_flight;
}

/*
 * Let libcurl work on the requests in flight, and return the deliveries
 * whose request completed, with their outcome set (a List of RelayItem *,
 * in the current memory context).  Never waits.  A request that found no
 * file descriptor to spare waits until another completes; when none is in
 * flight, idle connections are closed and it is tried once more.
 */
List *
http_async_collect(void)
{
	CURLM	   *m;
	List	   *done = NIL;
	CURLMsg    *msg;
	int			running;
	int			left;
	int			freed = 0;

	async_news = false;
	if (async_in_flight == 0)
		return NIL;
	m = http_multi();
	if (!dlist_is_empty(&async_requests) &&
		curl_multi_perform(m, &running) != CURLM_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("libcurl failed while sending webhooks")));
	while ((msg = curl_multi_info_read(m, &left)) != NULL)
	{
		HttpRequest *req;

		if (msg->msg != CURLMSG_DONE)
			continue;
		curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **) &req);
		dlist_delete(&req->node);

		if (req->no_fd && msg->data.result != CURLE_OK && !req->retried_fd)
		{
			http_finish(m, req);
			req->item->sent = false;
			dlist_push_tail(&async_waiting, &req->node);
			continue;
		}
		async_in_flight--;
		freed++;
		{
			/* The error message lives as long as the delivery: in its batch. */
			MemoryContext old = MemoryContextSwitchTo(req->cxt);

			http_outcome(req, msg->data.result);
			MemoryContextSwitchTo(old);
		}
		http_finish(m, req);
		done = lappend(done, req->item);
		pfree(req);
	}

	/*
	 * Requests waiting for a descriptor: one may go for each that completed;
	 * with nothing else in flight, all of them, once, after closing the idle
	 * connections (to other hosts, say), which hold descriptors too.
	 */
	if (!dlist_is_empty(&async_waiting) && dlist_is_empty(&async_requests))
	{
		dlist_iter	iter;

		http_multi_close();
		dlist_foreach(iter, &async_waiting)
			dlist_container(HttpRequest, node, iter.cur)->retried_fd = true;
		freed = async_in_flight;
	}
	for (; freed > 0 && !dlist_is_empty(&async_waiting); freed--)
		http_async_launch(dlist_container(HttpRequest, node,
										  dlist_pop_head_node(&async_waiting)));
	return done;
}

/*
 * Abandon every request of the relay loop (after an error): their claims
 * stay, and are taken again after their visibility deadline.  The multi
 * handle stays usable.
 */
void
http_async_abandon(void)
{
	while (!dlist_is_empty(&async_requests))
	{
		HttpRequest *req = dlist_container(HttpRequest, node, dlist_pop_head_node(&async_requests));

		http_finish(multi, req);
		pfree(req);
	}
	while (!dlist_is_empty(&async_waiting))
	{
		HttpRequest *req = dlist_container(HttpRequest, node, dlist_pop_head_node(&async_waiting));

		pfree(req);
	}
	async_in_flight = 0;
	async_news = false;
}

/*
 * Sleep until a socket of a request in flight is ready, libcurl's next
 * timer (a request's timeout) is due, the latch is set (a publishing
 * commit, SIGHUP, SIGTERM) or timeout_ms has passed.  Returns at once when
 * libcurl has work to do now, or requests completed that are not collected
 * yet.
 */
bool
http_async_wait(long timeout_ms, uint32 wait_event_info)
{
	fd_set		rd;
	fd_set		wr;
	fd_set		ex;
	int			maxfd = -1;
	long		curl_ms = -1;
	int			nevents = 2;
	WaitEventSet *set;
	WaitEvent	events[8];
	int			n;
	volatile bool latch_set = false;
	volatile long wait_ms;

	if (async_news)
		return false;
	if (async_in_flight > 0 && multi != NULL)
	{
		FD_ZERO(&rd);
		FD_ZERO(&wr);
		FD_ZERO(&ex);
		if (curl_multi_fdset(multi, &rd, &wr, &ex, &maxfd) != CURLM_OK)
			maxfd = -1;
		(void) curl_multi_timeout(multi, &curl_ms);
		if (curl_ms >= 0)
			timeout_ms = Min(timeout_ms, curl_ms);
		/* Sockets libcurl does not show (resolving, say): look again soon. */
		if (maxfd < 0)
			timeout_ms = Min(timeout_ms, HTTP_POLL_MS);
		for (int fd = 0; fd <= maxfd; fd++)
			if (FD_ISSET(fd, &rd) || FD_ISSET(fd, &wr))
				nevents++;
	}
	if (timeout_ms <= 0)
		return false;
	wait_ms = timeout_ms;

#if PG_VERSION_NUM >= 170000
	set = CreateWaitEventSet(NULL, nevents);
#else
	set = CreateWaitEventSet(CurrentMemoryContext, nevents);
#endif
	PG_TRY();
	{
		AddWaitEventToSet(set, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
		AddWaitEventToSet(set, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
		for (int fd = 0; fd <= maxfd; fd++)
		{
			uint32		ev = 0;

			if (FD_ISSET(fd, &rd))
				ev |= WL_SOCKET_READABLE;
			if (FD_ISSET(fd, &wr))
				ev |= WL_SOCKET_WRITEABLE;
			if (ev != 0)
				AddWaitEventToSet(set, ev, fd, NULL, NULL);
		}
		n = WaitEventSetWait(set, wait_ms, events, lengthof(events), wait_event_info);
		for (int i = 0; i < n; i++)
			if (events[i].events & WL_LATCH_SET)
				latch_set = true;
	}
	PG_FINALLY();
	{
		FreeWaitEventSet(set);
	}
	PG_END_TRY();
	if (latch_set)
		ResetLatch(MyLatch);
	return latch_set;
}

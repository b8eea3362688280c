/*
 * curl_floor: the HTTP side of the relay alone, for bench/relay.sh.
 *
 * Sends N POSTs to a URL with libcurl the way src/relay_http.c does -- one
 * multi handle, at most IN_FLIGHT requests on kept-alive connections, easy
 * handles reset and reused, the same headers, body and timeouts (those of a
 * destination with the default options), curl_multi_perform and
 * curl_multi_poll -- but with no database work and no signing (its
 * webhook-signature header is a fixed one of the same size).  What it
 * reaches is the most a libcurl relay could reach on this machine; the
 * benchmark sets the relay against it, and it against wrk.
 *
 *	cc -O2 -o curl_floor curl_floor.c -lcurl
 *	./curl_floor URL N IN_FLIGHT		prints "N requests in S s"
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>

#include <curl/curl.h>

static const char body[] = "{\"amount\": 10, \"currency\": \"EUR\", \"order\": 123456}";

/* Discard the response body, as the relay does. */
static size_t
discard(char *ptr, size_t size, size_t nmemb, void *userdata)
{
	(void) ptr;
	(void) userdata;
	return size * nmemb;
}

/* Seconds on the monotonic clock. */
static double
now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* Start one request on m, on a spare handle if there is one. */
static void
start(CURLM *m, const char *url, CURL **spare, int *nspare)
{
	CURL	   *e = *nspare > 0 ? spare[--*nspare] : curl_easy_init();
	struct curl_slist *h = NULL;

	if (e == NULL)
	{
		fprintf(stderr, "curl_easy_init failed\n");
		exit(1);
	}
	curl_easy_reset(e);
	h = curl_slist_append(h, "Content-Type: application/json");
	h = curl_slist_append(h, "Expect:");
	h = curl_slist_append(h, "webhook-id: 01a2270b-7091-7000-8000-000000000000");
	h = curl_slist_append(h, "webhook-timestamp: 1800000000");
	h = curl_slist_append(h, "webhook-signature: v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=");
	curl_easy_setopt(e, CURLOPT_URL, url);
	curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
	curl_easy_setopt(e, CURLOPT_PROXY, "");
	curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
	curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e, CURLOPT_POST, 1L);
	curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
	curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t) strlen(body));
	curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
	curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 10000L);
	curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
	curl_easy_setopt(e, CURLOPT_USERAGENT, "idempotency-relay/1.3");
	curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, discard);
	curl_easy_setopt(e, CURLOPT_PRIVATE, h);
	if (curl_multi_add_handle(m, e) != CURLM_OK)
	{
		fprintf(stderr, "curl_multi_add_handle failed\n");
		exit(1);
	}
}

int
main(int argc, char **argv)
{
	const char *url;
	int			total;
	int			in_flight;
	CURLM	   *m;
	CURL	  **spare;
	int			nspare = 0;
	int			started = 0;
	int			done = 0;
	int			running = 0;
	double		t0;

	if (argc != 4 || (total = atoi(argv[2])) < 1 || (in_flight = atoi(argv[3])) < 1)
	{
		fprintf(stderr, "usage: %s URL N IN_FLIGHT\n", argv[0]);
		return 2;
	}
	url = argv[1];
	curl_global_init(CURL_GLOBAL_DEFAULT);
	m = curl_multi_init();
	curl_multi_setopt(m, CURLMOPT_MAX_HOST_CONNECTIONS, (long) in_flight);
	curl_multi_setopt(m, CURLMOPT_MAXCONNECTS, (long) in_flight);
	spare = calloc(in_flight, sizeof(CURL *));

	t0 = now();
	while (done < total)
	{
		int			still;
		int			left;
		CURLMsg    *msg;

		while (running < in_flight && started < total)
		{
			start(m, url, spare, &nspare);
			started++;
			running++;
		}
		curl_multi_perform(m, &still);
		while ((msg = curl_multi_info_read(m, &left)) != NULL)
		{
			long		status = 0;
			struct curl_slist *h;

			if (msg->msg != CURLMSG_DONE)
				continue;
			curl_easy_getinfo(msg->easy_handle, CURLINFO_RESPONSE_CODE, &status);
			if (msg->data.result != CURLE_OK || status < 200 || status > 299)
			{
				fprintf(stderr, "request failed: %s, status %ld\n",
						curl_easy_strerror(msg->data.result), status);
				return 1;
			}
			curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **) &h);
			curl_multi_remove_handle(m, msg->easy_handle);
			curl_slist_free_all(h);
			spare[nspare++] = msg->easy_handle;
			done++;
			running--;
		}
		if (running >= in_flight || started >= total)
		{
			int			numfds;

			curl_multi_poll(m, NULL, 0, 50, &numfds);
		}
	}
	printf("%d requests in %.3f s\n", total, now() - t0);
	/* The process's CPU time per request, to set beside the relay worker's. */
	{
		struct rusage ru;

		getrusage(RUSAGE_SELF, &ru);
		printf("cpu %.1f us per request\n",
			   ((ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
				ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / total);
	}
	return 0;
}

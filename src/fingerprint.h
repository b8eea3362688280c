/*-------------------------------------------------------------------------
 *
 * fingerprint.h
 *	  Canonical JSON text and SHA-256 fingerprint of a jsonb request.
 *
 * See fingerprint.c for the definition of the canonical form.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_FINGERPRINT_H
#define IDEM_FINGERPRINT_H

#include "postgres.h"

#include "lib/stringinfo.h"
#include "utils/jsonb.h"

#define IDEM_SHA256_LEN 32

/* appends canonical text, server encoding */
extern void idem_canonical_append(StringInfo out, Jsonb *jb);

/* out: IDEM_SHA256_LEN bytes */
extern void idem_sha256(const void *data, size_t len, uint8 *out);

/* palloc'd bytea of IDEM_SHA256_LEN bytes */
extern bytea *idem_fingerprint_jsonb(Jsonb *jb);

#endif							/* IDEM_FINGERPRINT_H */

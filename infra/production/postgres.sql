-- The Prefect server's database. Run as a PostgreSQL superuser:
--   psql -f infra/production/postgres.sql
CREATE ROLE prefect LOGIN PASSWORD 'CHANGE_ME';
CREATE DATABASE prefect OWNER prefect;
\connect prefect
-- Prefect's migrations need trigram indexes.
CREATE EXTENSION IF NOT EXISTS pg_trgm;

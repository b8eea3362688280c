// A throwaway PostgreSQL cluster with the idempotency extension, for tests and
// the example: initdb in /tmp, run as the user "postgres" when we are root
// (PostgreSQL refuses to run as root), reachable on a Unix socket in its own
// directory, removed by stop().
//
// PG_BINDIR: the PostgreSQL binaries whose installation has the extension
// (test/node.sh sets it to its staging copy); default: pg_config --bindir.
import { execFileSync, spawnSync } from "node:child_process";
import { chownSync, mkdtempSync, appendFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import pg from "pg";

function bindir() {
  if (process.env.PG_BINDIR) return process.env.PG_BINDIR;
  return execFileSync("pg_config", ["--bindir"], { encoding: "utf8" }).trim();
}

function asPostgres(cmd, args) {
  const root = process.getuid?.() === 0;
  const r = root
    ? spawnSync("runuser", ["-u", "postgres", "--", cmd, ...args], { encoding: "utf8" })
    : spawnSync(cmd, args, { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(" ")} failed: ${r.stderr || r.stdout}`);
  return r.stdout;
}

/**
 * Start a cluster. extraConf: more postgresql.conf lines. Returns { host, port,
 * database, user, pool(options), query(sql, values), stop() }.
 */
export async function startCluster({ extraConf = [], listenTcp = false } = {}) {
  const bin = bindir();
  const dir = mkdtempSync("/tmp/idem-node-pg.");
  if (process.getuid?.() === 0) {
    const uid = Number(execFileSync("id", ["-u", "postgres"], { encoding: "utf8" }));
    const gid = Number(execFileSync("id", ["-g", "postgres"], { encoding: "utf8" }));
    chownSync(dir, uid, gid);
  }
  const data = join(dir, "data");
  const port = 20000 + Math.floor(Math.random() * 30000);
  asPostgres(join(bin, "initdb"), ["-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale"]);
  appendFileSync(data + "/postgresql.conf", [
    `port = ${port}`,
    `unix_socket_directories = '${dir}'`,
    `listen_addresses = '${listenTcp ? "127.0.0.1" : ""}'`,
    "shared_preload_libraries = 'idempotency'",
    "fsync = off",
    "max_connections = 60",
    ...extraConf,
    "",
  ].join("\n"));
  asPostgres(join(bin, "pg_ctl"), ["-D", data, "-l", join(dir, "server.log"), "-w", "start"]);
  const connection = { host: dir, port, user: "postgres", database: "postgres" };
  const admin = new pg.Client(connection);
  await admin.connect();
  await admin.query("CREATE EXTENSION idempotency");
  await admin.end();
  const pools = [];
  return {
    ...connection,
    dir,
    log: join(dir, "server.log"),
    pool(options = {}) {
      const p = new pg.Pool({ ...connection, ...options });
      pools.push(p);
      return p;
    },
    async query(sql, values) {
      const c = new pg.Client(connection);
      await c.connect();
      try {
        return await c.query(sql, values);
      } finally {
        await c.end();
      }
    },
    async stop() {
      await Promise.all(pools.map((p) => p.end().catch(() => undefined)));
      try {
        asPostgres(join(bin, "pg_ctl"), ["-D", data, "-m", "immediate", "stop"]);
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    },
  };
}

// Starts the example's world: a throwaway cluster with the extension (the
// relay worker on, allowed to post to 127.0.0.1), the schema, the gateway,
// the receiver, the outbox destination, and the service as a child process
// that is restarted whenever it dies.
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { fileURLToPath } from "node:url";
import { startCluster } from "../../clients/node/test/support/cluster.mjs";
import { startGateway } from "./gateway.mjs";
import { startReceiver } from "./receiver.mjs";

const here = fileURLToPath(new URL(".", import.meta.url));

export async function startWorld({ servicePort = 0, killEvery = 0, receiverFailEvery = 0, brokenInbox = false,
                                   log = console.log } = {}) {
  const cluster = await startCluster({
    extraConf: [
      "idempotency.databases = 'postgres'",
      "idempotency.relay_allowed_networks = '127.0.0.1'",
    ],
  });
  await cluster.query(`CREATE TABLE payments (
      id serial PRIMARY KEY, amount int NOT NULL, status text NOT NULL,
      charge_id text, created_with text NOT NULL)`);
  const gateway = await startGateway();
  const pool = cluster.pool({ max: 10 });
  const secret = "whsec_" + randomBytes(32).toString("base64");
  const receiver = await startReceiver({ pool, secret, failEvery: receiverFailEvery, brokenInbox });
  await cluster.query(
    "SELECT idem_destination_create('receiver', 'http', $1, '{payment.*}', $2::jsonb)",
    [`${receiver.url}/webhooks`, JSON.stringify({ secret, backoff_base: "100ms", backoff_cap: "1s", max_attempts: 1000 })]);

  if (!servicePort) {
    const probe = await startGateway();
    servicePort = probe.server.address().port;
    await new Promise((resolve) => probe.server.close(resolve));
  }
  let child, stopping = false, restarts = 0;
  const env = {
    ...process.env, PGHOST: cluster.host, PGPORT: String(cluster.port), PGUSER: "postgres",
    PGDATABASE: "postgres", PORT: String(servicePort), GATEWAY_URL: gateway.url,
    CHAOS_KILL_EVERY: String(killEvery),
  };
  const serviceUrl = `http://127.0.0.1:${servicePort}`;
  // Resolves once the service (re)started answers: polled, however slow the
  // machine, until stop().
  let ready;
  const waitUntilAnswers = async () => {
    while (!stopping) {
      try {
        await fetch(serviceUrl + "/operations/none", { signal: AbortSignal.timeout(5000) });
        return;
      } catch {
        await new Promise((r) => setTimeout(r, 50));
      }
    }
  };
  const startService = () => {
    child = spawn(process.execPath, [here + "service.mjs"], { env, stdio: ["ignore", "pipe", "pipe"] });
    child.stdout.on("data", (d) => log(String(d).trimEnd()));
    child.stderr.on("data", (d) => log(String(d).trimEnd()));
    child.on("exit", (code, signal) => {
      if (stopping) return;
      restarts++;
      log(`service exited (${signal ?? code}); restarting`);
      startService();
    });
    ready = waitUntilAnswers();
  };
  startService();
  await ready;
  return {
    cluster, gateway, receiver, pool, serviceUrl,
    restarts: () => restarts,
    /** Resolves when the service answers (at once unless it is restarting). */
    whenReady: () => ready,
    async stop() {
      stopping = true;
      child.kill("SIGKILL");
      gateway.server.close();
      receiver.server.close();
      await cluster.stop();
    },
  };
}

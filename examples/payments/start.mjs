// One command: `npm start` (or node start.mjs) runs the example on a
// throwaway cluster until Ctrl-C, and prints how to try it.
import { startWorld } from "./setup.mjs";

const world = await startWorld({ servicePort: Number(process.env.PORT ?? 3000) });
const u = world.serviceUrl;
console.log(`
payments service  ${u}
card gateway      ${world.gateway.url}   (GET /charges lists every charge)
webhook receiver  ${world.receiver.url}
PostgreSQL        psql -h ${world.cluster.host} -p ${world.cluster.port} -U postgres

Try:
  curl -si -X POST ${u}/payments -H 'Idempotency-Key: k1' -H 'Content-Type: application/json' -d '{"amount": 1000}'
  (again: the same answer, with Idempotent-Replayed: true)
  curl -si -X POST ${u}/payments/1/capture -H 'Idempotency-Key: k2'
  curl -s ${u}/operations/k2
  psql ... -c 'TABLE receiver_applied'
Ctrl-C stops everything and removes the cluster.`);
const stop = async () => { await world.stop(); process.exit(0); };
process.on("SIGINT", stop);
process.on("SIGTERM", stop);

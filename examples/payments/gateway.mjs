// A simulated card gateway: POST /charges honours its own Idempotency-Key (a
// repeated key returns the first charge), GET /charges/:key looks a key up,
// GET /charges lists every charge it ever made (what the chaos test checks).
import http from "node:http";
import { randomUUID } from "node:crypto";

export function startGateway(port = 0) {
  const charges = new Map(); // idempotency key -> charge
  const server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (c) => { body += c; });
    req.on("end", () => {
      const answer = (status, value) => {
        res.writeHead(status, { "content-type": "application/json" });
        res.end(JSON.stringify(value));
      };
      if (req.method === "POST" && req.url === "/charges") {
        const key = req.headers["idempotency-key"];
        if (!key) return answer(400, { error: "Idempotency-Key required" });
        let charge = charges.get(key);
        if (!charge) {
          charge = { id: `ch_${randomUUID()}`, key, ...JSON.parse(body || "{}"), at: new Date().toISOString() };
          charges.set(key, charge);
        }
        return answer(201, charge);
      }
      const m = /^\/charges\/([^/]+)$/.exec(req.url ?? "");
      if (req.method === "GET" && m) {
        const charge = charges.get(decodeURIComponent(m[1]));
        return charge ? answer(200, charge) : answer(404, { error: "no such charge" });
      }
      if (req.method === "GET" && req.url === "/charges") return answer(200, [...charges.values()]);
      answer(404, { error: "not found" });
    });
  });
  return new Promise((resolve) => server.listen(port, "127.0.0.1", () =>
    resolve({ server, url: `http://127.0.0.1:${server.address().port}`, charges })));
}

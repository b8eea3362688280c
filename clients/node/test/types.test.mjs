// The README examples type-check against the built declarations (dist/*.d.ts)
// with `tsc --noEmit`, strict, as a TypeScript application would use them:
// the package README's Express quick start and retrying client, and the
// repository README's Express example ("From an HTTP service"). Each
// example is taken from the README as it is, after a prelude that declares
// what the application itself provides (its authentication's req.user).
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const pkg = fileURLToPath(new URL("..", import.meta.url));

/** The first ```js or ```ts block after the line `heading` of the file. */
function example(file, heading) {
  const text = readFileSync(join(pkg, file), "utf8");
  const at = text.split("\n").findIndex((line) => line === heading);
  assert.ok(at >= 0, `${file}: no heading ${heading}`);
  const rest = text.split("\n").slice(at + 1).join("\n");
  const m = rest.match(/```(?:js|ts)\n([\s\S]*?)```/);
  assert.ok(m, `${file}: no js or ts block after ${heading}`);
  return m[1];
}

// What a Fastify application's authentication declares.
const FASTIFY_AUTH = `declare module "fastify" {
  interface FastifyRequest { user: { tenantId: string } }
}
`;

// What an Express application's authentication declares.
const EXPRESS_AUTH = `declare global {
  namespace Express {
    interface Request { user: { tenantId: string } }
  }
}
`;

const fixtures = {
  "express-quick-start.ts": EXPRESS_AUTH + example("README.md", "## Quick start (Express 5)"),
  "fastify.ts": FASTIFY_AUTH + example("README.md", "## Fastify 5"),
  "retrying-client.ts": example("README.md", "## Retrying client") + "\nexport { res, IdempotentRequestError };\n",
  "repo-readme-express.ts": EXPRESS_AUTH + example("../../README.md", "### From an HTTP service"),
};

test("the README examples type-check (tsc --noEmit, strict)", () => {
  // Inside the package, so that "@idempotency/pg" resolves to it (its
  // exports: dist/index.d.ts) and its node_modules hold the types.
  const dir = mkdtempSync(join(pkg, "test", ".types-"));
  try {
    for (const [name, code] of Object.entries(fixtures)) writeFileSync(join(dir, name), code);
    writeFileSync(join(dir, "tsconfig.json"), JSON.stringify({
      compilerOptions: {
        target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true,
        noEmit: true, skipLibCheck: false, types: ["node"], lib: ["ES2022", "DOM"],
      },
      files: Object.keys(fixtures),
    }));
    let output = "";
    try {
      execFileSync(process.execPath, [join(pkg, "node_modules/typescript/bin/tsc"), "-p", dir],
        { encoding: "utf8", stdio: "pipe" });
    } catch (err) {
      output = `${err.stdout}${err.stderr}`;
    }
    assert.equal(output, "", `tsc found errors in the README examples:\n${output}`);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

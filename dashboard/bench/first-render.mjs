// Time to first render of a task's page in Debian's Chromium (playwright-core), for each task
// named, over fresh page loads: from the navigation's start to the first frame that shows the
// task with its latest rounds (`data-rendered`), and to the one with its whole history loaded
// into the charts (`data-complete`). Run by benches/dashboard.rs, which prints the figures.
//
// Environment: HORA_URL, HORA_TOKEN, HORA_TASKS (comma-separated), HORA_REPEAT, HORA_CHROMIUM.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const { HORA_URL: url, HORA_TOKEN: token, HORA_TASKS: tasks, HORA_REPEAT: repeat, HORA_CHROMIUM: browserPath } = process.env;
const profile = mkdtempSync(join(tmpdir(), 'hora-chromium-'));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: browserPath,
  headless: true,
  ignoreHTTPSErrors: true,
  viewport: { width: 1280, height: 900 },
  args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
try {
  const page = context.pages()[0] || await context.newPage();
  await page.goto(`${url}/dashboard/`);
  await page.getByLabel('Admin token').fill(token);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.locator('#tasks').waitFor();
  for (const task of tasks.split(',')) {
    const rendered = [];
    const complete = [];
    for (let i = 0; i < Number(repeat) + 1; i += 1) {
      await page.goto('about:blank');
      await page.goto(`${url}/dashboard/#/tasks/${task}`);
      await page.waitForFunction(() => document.body.dataset.complete, null, { timeout: 120000 });
      const [r, c, points] = await page.evaluate(() => [
        Number(document.body.dataset.rendered), Number(document.body.dataset.complete),
        Number(document.querySelector('#chart-evaluation').dataset.points)]);
      if (i > 0) { // the first load warms the browser's cache of the page and its script
        rendered.push(r);
        complete.push(c);
      }
      if (i === 0) console.error(`${task}: ${points} points in the evaluation chart`);
    }
    console.log(JSON.stringify({ task, rendered, complete }));
  }
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}

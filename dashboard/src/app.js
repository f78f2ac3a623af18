// Hora's operator dashboard: one page, routed by the URL's fragment (#/, #/tasks/{id},
// #/clients, #/sync). Everything it shows comes from the admin API (/admin/v1), which takes the
// session cookie set at sign-in; state-changing calls carry the session's CSRF token, held in
// memory only (never in the browser's storage). Live: the server's event feed
// (/dashboard/api/events) sends every task whenever one changes. Text from the server is only
// ever set as text, never parsed as HTML.

import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';
import './app.css';

const HISTORY_FIRST = 200; // rounds shown at once; the rest load in the background
const HISTORY_PAGE = 2000;
const TABLE_ROWS = 50;

const app = {
  csrf: null,
  tasks: [],
  broken: [], // tasks whose stored state the server could not load
  feed: null,
  view: null, // { render(tasks) } of the page shown, told of every feed event
};

// ---- DOM helpers --------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const main = () => document.getElementById('main');

function show(...nodes) {
  const m = main();
  m.replaceChildren(...nodes);
}

function fmtTime(ms) {
  if (!ms) return '—';
  return new Date(ms).toLocaleString();
}

function ago(ms) {
  if (!ms) return 'not since the server started';
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

// A configuration object as text: `epochs 1, optimizer sgd (momentum 0), …`.
function describe(v) {
  if (v === null || v === undefined) return '—';
  if (Array.isArray(v)) return v.map(describe).join(', ');
  if (typeof v !== 'object') return String(v);
  const { name, mode, kind, ...rest } = v;
  const head = name ?? mode ?? kind;
  const body = Object.entries(rest).map(([k, x]) => `${k.replaceAll('_', ' ')} ${typeof x === 'object' && x !== null ? `(${describe(x)})` : describe(x)}`).join(', ');
  return head === undefined ? body : body ? `${head} (${body})` : String(head);
}

function num(v, digits = 4) {
  return v === null || v === undefined ? '—' : Number(v).toFixed(digits);
}

// ---- API ----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, body) {
  const headers = {};
  if (body !== undefined) headers['content-type'] = 'application/json';
  if (method !== 'GET' && app.csrf) headers['x-csrf-token'] = app.csrf;
  const r = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: 'same-origin',
  });
  if (r.status === 401 && !path.startsWith('/dashboard/api/session')) {
    signedOut('Your session ended: sign in again.');
    throw new ApiError(401, 'signed out');
  }
  if (!r.ok) {
    let message = `${r.status} ${r.statusText}`;
    try {
      const e = await r.json();
      message = e.message || e.error || message;
    } catch (_) { /* not JSON */ }
    throw new ApiError(r.status, message);
  }
  if (r.status === 204) return null;
  return r.json();
}

// ---- Session ------------------------------------------------------------------------------

function signedOut(message) {
  app.csrf = null;
  if (app.feed) app.feed.close();
  app.feed = null;
  document.getElementById('nav').hidden = true;
  document.getElementById('sign-out').hidden = true;
  document.getElementById('live').textContent = '';
  signInPage(message);
}

function signInPage(message) {
  app.view = null;
  const error = h('p', { class: 'error', role: 'alert', id: 'sign-in-error' }, message || '');
  const input = h('input', {
    id: 'token', name: 'token', type: 'password', autocomplete: 'off', required: true,
    'aria-describedby': 'sign-in-error',
  });
  const form = h('form', { class: 'panel signin', 'aria-labelledby': 'sign-in-title' },
    h('h1', { id: 'sign-in-title' }, 'Sign in'),
    h('p', { class: 'muted' }, 'Give the server\'s admin token. It is exchanged for a session; the page does not keep it.'),
    h('label', { for: 'token' }, 'Admin token'),
    input,
    h('button', { class: 'primary', type: 'submit' }, 'Sign in'),
    error);
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const token = input.value;
    input.value = '';
    try {
      const s = await api('POST', '/dashboard/api/session', { token });
      startSession(s);
    } catch (e) {
      error.textContent = e.status === 401 ? 'That is not the admin token.' : e.message;
      input.focus();
    }
  });
  show(form);
  input.focus();
}

function startSession(session) {
  app.csrf = session.csrf;
  document.getElementById('nav').hidden = false;
  document.getElementById('sign-out').hidden = false;
  openFeed();
  route();
}

async function signOut() {
  try {
    await api('DELETE', '/dashboard/api/session');
  } catch (_) { /* signed out either way */ }
  signedOut('Signed out.');
}

// ---- Live feed ----------------------------------------------------------------------------

function openFeed() {
  if (app.feed) app.feed.close();
  const live = document.getElementById('live');
  const feed = new EventSource('/dashboard/api/events');
  feed.addEventListener('tasks', (ev) => {
    const feed = JSON.parse(ev.data);
    app.tasks = feed.tasks;
    app.broken = feed.broken;
    live.textContent = `Live · updated ${new Date().toLocaleTimeString()}`;
    if (app.view) app.view.render(app.tasks);
  });
  feed.onerror = async () => {
    live.textContent = 'Reconnecting…';
    // The browser retries by itself after a dropped connection, but not after an error status
    // (a load balancer's 502 while the server restarts): then the feed is opened again here.
    // A session that ended is found out by the check.
    try {
      await api('GET', '/dashboard/api/session');
    } catch (_) { return; /* signed out: handled by api() */ }
    if (feed.readyState === EventSource.CLOSED && app.feed === feed) {
      app.retry = Math.min(30000, (app.retry || 1000) * 2);
      setTimeout(() => { if (app.feed === feed) openFeed(); }, app.retry);
    }
  };
  feed.onopen = () => { app.retry = 0; };
  app.feed = feed;
}

// ---- Routing ------------------------------------------------------------------------------

function route() {
  if (!app.csrf) return;
  const hash = location.hash || '#/';
  for (const a of document.querySelectorAll('#nav a')) {
    const here = a.getAttribute('href') === hash || (a.getAttribute('href') === '#/' && hash.startsWith('#/tasks/'));
    if (here) a.setAttribute('aria-current', 'page'); else a.removeAttribute('aria-current');
  }
  if (app.view && app.view.close) app.view.close();
  const task = hash.match(/^#\/tasks\/([A-Za-z0-9_.-]{1,64})$/);
  if (task) taskPage(task[1]);
  else if (hash === '#/clients') clientsPage();
  else if (hash === '#/sync') syncPage();
  else overviewPage();
  main().focus({ preventScroll: true });
}

// ---- Overview -----------------------------------------------------------------------------

function mode(t) {
  const c = t.config;
  const parts = [c.asynchronous ? 'asynchronous' : c.secure_aggregation ? 'secure aggregation' : 'synchronous'];
  if (c.differential_privacy) parts.push('DP');
  return parts.join(' · ');
}

function stateBadge(state) {
  return h('span', { class: `badge state-${state}` }, state);
}

function overviewPage() {
  const tableBody = h('tbody');
  const alerts = h('ul', { class: 'alerts', 'aria-live': 'polite' });
  const alertsOf = new Map(); // task → alerts from its recent history
  let quarantined = [];
  const summary = h('dl', { class: 'summary panel', id: 'summary', 'aria-label': 'Clients' });
  show(
    h('h1', {}, 'Overview'),
    summary,
    h('section', { 'aria-labelledby': 'alerts-title' }, h('h2', { id: 'alerts-title' }, 'Alerts'), alerts),
    h('div', { class: 'table-wrap' },
      h('table', { id: 'tasks' },
        h('caption', {}, 'Tasks'),
        h('thead', {}, h('tr', {},
          ['Task', 'Mode', 'State', 'Progress', 'Open round', 'Clients in round', 'Deadline'].map((c) => h('th', { scope: 'col' }, c)))),
        tableBody)));

  function renderAlerts() {
    const items = [];
    for (const t of app.tasks) {
      if (t.ended_reason) items.push([`Task ${t.config.id} ended early: ${t.ended_reason}`, 'bad']);
      for (const a of alertsOf.get(t.config.id) || []) items.push(a);
    }
    for (const id of app.broken) items.push([`Task ${id} is broken: its stored state could not be loaded (the server's log says why); it answers 503 until repaired`, 'bad']);
    for (const c of quarantined) items.push([`Client ${c.client_id} is quarantined: ${c.quarantined}`, 'bad']);
    alerts.replaceChildren(...(items.length
      ? items.map(([text, kind]) => h('li', { class: kind }, text))
      : [h('li', { class: 'muted' }, 'Nothing needs attention.')]));
  }

  async function recent(t) {
    const after = Math.max(0, t.published_rounds - 20);
    try {
      const rounds = await api('GET', `/admin/v1/tasks/${t.config.id}/rounds?after=${after}&limit=100`);
      const list = [];
      const abandoned = rounds.filter((r) => r.outcome.status === 'abandoned');
      if (abandoned.length) {
        const last = abandoned[abandoned.length - 1];
        list.push([`Task ${t.config.id}: ${abandoned.length} abandoned round attempt(s) lately; round ${last.round}: ${last.outcome.reason}`, 'warn']);
      }
      const budget = t.config.differential_privacy && t.config.differential_privacy.epsilon_budget;
      const spent = rounds.filter((r) => r.privacy).map((r) => r.privacy.epsilon).pop();
      if (budget && spent !== undefined && spent >= 0.8 * budget) {
        list.push([`Task ${t.config.id}: privacy budget ${Math.round((100 * spent) / budget)}% spent (ε ${spent.toFixed(2)} of ${budget})`, spent >= budget ? 'bad' : 'warn']);
      }
      alertsOf.set(t.config.id, list);
    } catch (_) { /* shown on the next event */ }
  }

  let seen = new Map();
  async function render(tasks) {
    tableBody.replaceChildren(...tasks.map((t) => {
      const c = t.config;
      const open = t.open_round;
      return h('tr', {},
        h('th', { scope: 'row' }, h('a', { href: `#/tasks/${c.id}` }, c.id)),
        h('td', {}, mode(t)),
        h('td', {}, stateBadge(t.state)),
        h('td', {}, h('progress', { max: c.rounds, value: t.published_rounds, 'aria-label': `${t.published_rounds} of ${c.rounds}` }),
          ` ${t.published_rounds} / ${c.rounds}`),
        h('td', { class: 'num' }, open ? `${open.round}${open.attempt ? ` (attempt ${open.attempt + 1})` : ''}${open.stage ? `, ${open.stage.replace('_', ' ')}` : ''}` : '—'),
        h('td', { class: 'num' }, open ? `${open.accepted} of ${open.selected}` : '—'),
        h('td', {}, open ? fmtTime(open.deadline_unix_ms) : '—'));
    }));
    const changed = tasks.filter((t) => seen.get(t.config.id) !== t.published_rounds);
    seen = new Map(tasks.map((t) => [t.config.id, t.published_rounds]));
    await Promise.all(changed.map(recent));
    renderAlerts();
  }

  app.view = { render };
  render(app.tasks);
  api('GET', '/admin/v1/clients').then((clients) => {
    quarantined = clients.filter((c) => c.quarantined);
    const recently = Date.now() - 5 * 60 * 1000;
    const seen = clients.filter((c) => c.last_seen_unix_ms);
    const last = seen.reduce((m, c) => Math.max(m, c.last_seen_unix_ms), 0);
    const figures = [
      ['Clients enrolled', clients.filter((c) => !c.revoked).length],
      ['Active in the last 5 min', seen.filter((c) => c.last_seen_unix_ms >= recently).length],
      ['Last seen', last ? ago(last) : '—'],
      ['Quarantined', quarantined.length],
      ['Revoked', clients.filter((c) => c.revoked).length],
    ];
    summary.replaceChildren(...figures.map(([k, v]) => h('div', {}, h('dt', {}, k), h('dd', {}, v))));
    renderAlerts();
  }).catch(() => {});
}

// ---- A task -------------------------------------------------------------------------------

function chart(title, series, { bars = false, id } = {}) {
  const holder = h('div', { class: 'chart', id, role: 'img', 'aria-label': title, 'data-points': '0' });
  const figure = h('figure', { class: 'panel' }, h('figcaption', {}, h('strong', {}, title)), holder);
  let plot = null;
  const width = () => Math.max(260, holder.clientWidth || 600);
  const colours = ['#0b5cad', '#c2410c', '#15803d', '#7e22ce'];
  function set(data) {
    const points = data.length > 1 ? data[1].filter((v) => v !== null && v !== undefined).length : 0;
    holder.dataset.points = String(points);
    holder.setAttribute('aria-label', `${title}: ${points} points`);
    if (plot) {
      plot.setData(data);
      return;
    }
    const opts = {
      width: width(),
      height: 220,
      scales: { x: { time: false } },
      series: [
        { label: series.x },
        ...series.y.map((s, i) => ({
          label: s.label,
          stroke: colours[i % colours.length],
          width: 2,
          scale: s.scale || 'y',
          spanGaps: true,
          ...(bars ? { fill: `${colours[i % colours.length]}66`, paths: uPlot.paths.bars({ size: [0.7, 40] }) } : { points: { show: data[0].length < 60 } }),
        })),
      ],
      axes: [
        { label: series.x },
        { label: series.y[0].label, scale: series.y[0].scale || 'y' },
        ...(series.y.some((s) => s.scale === 'right')
          ? [{ side: 1, scale: 'right', grid: { show: false }, label: series.y.find((s) => s.scale === 'right').label }]
          : []),
      ],
    };
    plot = new uPlot(opts, data, holder);
  }
  const resize = new ResizeObserver(() => { if (plot) plot.setSize({ width: width(), height: 220 }); });
  resize.observe(holder);
  return { figure, set, close: () => resize.disconnect() };
}

function taskPage(id) {
  const entries = new Map(); // `${round}.${attempt}` → record
  let task = app.tasks.find((t) => t.config.id === id);
  let page = 0; // 0: the latest TABLE_ROWS entries
  let loadingOlder = null;
  let oldestLoaded = null; // the lowest round fetched so far (null: nothing yet)

  const title = h('h1', {}, `Task ${id}`);
  const status = h('p', { class: 'muted', 'aria-live': 'polite' });
  const actions = h('div', { class: 'actions' });
  const config = h('dl', { class: 'config' });
  const charts = {
    loss: chart('Training loss per round', { x: 'round', y: [{ label: 'training loss' }] }, { id: 'chart-training' }),
    evaluation: chart('Federated evaluation', { x: 'round', y: [{ label: 'loss' }, { label: 'accuracy', scale: 'right' }] }, { id: 'chart-evaluation' }),
    privacy: chart('Privacy spent (ε)', { x: 'round', y: [{ label: 'ε' }] }, { id: 'chart-privacy' }),
    staleness: chart('Staleness of updates', { x: 'versions stale', y: [{ label: 'updates' }] }, { bars: true, id: 'chart-staleness' }),
  };
  const rows = h('tbody');
  const pager = h('div', { class: 'actions' });
  const dialog = h('dialog', { 'aria-labelledby': 'confirm-title' });
  show(
    title, status, actions, dialog,
    h('div', { class: 'grid' }, charts.evaluation.figure, charts.loss.figure, charts.privacy.figure, charts.staleness.figure),
    h('section', { class: 'panel', 'aria-labelledby': 'config-title' }, h('h2', { id: 'config-title' }, 'Configuration'), config),
    h('h2', {}, 'Rounds'),
    h('div', { class: 'table-wrap' }, h('table', { id: 'rounds' },
      h('caption', {}, 'Round timeline, newest first'),
      h('thead', {}, h('tr', {}, ['Round', 'Outcome', 'Participants', 'Dropped', 'Examples', 'Duration', 'Training loss', 'Eval. accuracy', 'ε', 'Model']
        .map((c) => h('th', { scope: 'col', class: ['Round', 'Participants', 'Dropped', 'Examples', 'Duration', 'Training loss', 'Eval. accuracy', 'ε'].includes(c) ? 'num' : undefined }, c)))),
      rows)),
    pager);

  function sorted() {
    return [...entries.values()].sort((a, b) => a.round - b.round || a.attempt - b.attempt);
  }

  function confirmThen(what, run) {
    dialog.replaceChildren(
      h('h2', { id: 'confirm-title' }, `${what} task ${id}?`),
      h('p', {}, what === 'Stop' ? 'A stopped task cannot be resumed: its open round is abandoned and no more rounds run.' : ''),
      h('div', { class: 'actions' },
        h('button', { class: 'danger', type: 'button', onclick: () => { dialog.close(); run(); } }, what),
        h('button', { type: 'button', onclick: () => dialog.close() }, 'Cancel')));
    dialog.showModal();
  }

  async function act(verb) {
    try {
      task = await api('POST', `/admin/v1/tasks/${id}/${verb}`);
      status.textContent = `Task ${verb === 'stop' ? 'stopped' : verb === 'pause' ? 'paused' : 'resumed'}.`;
      renderHeader();
    } catch (e) {
      status.textContent = `Could not ${verb} the task: ${e.message}`;
    }
  }

  function renderHeader() {
    if (!task) return;
    const c = task.config;
    title.replaceChildren(`Task ${id} `, stateBadge(task.state));
    const ended = task.state === 'stopped' || task.state === 'finished';
    actions.replaceChildren(
      task.state === 'paused'
        ? h('button', { type: 'button', onclick: () => act('resume'), disabled: ended }, 'Resume')
        : h('button', { type: 'button', onclick: () => act('pause'), disabled: ended }, 'Pause'),
      h('button', { type: 'button', class: 'danger', disabled: ended, onclick: () => confirmThen('Stop', () => act('stop')) }, 'Stop…'),
      h('span', { class: 'muted' }, `${task.published_rounds} of ${c.rounds} ${c.asynchronous ? 'versions' : 'rounds'} published · ${mode(task)}`));
    const strategy = { ...c.strategy };
    const name = strategy.name;
    delete strategy.name;
    const items = [
      ['Strategy', describe({ name, ...strategy })],
      ['Model', c.model.kind === 'builtin' ? `${c.model.name} (built in)` : 'TorchScript module'],
      ['Clients per round', `${c.min_clients} to ${c.target_clients}`],
      ['Round deadline', `${c.round_deadline_secs} s`],
      ['Training', describe(c.training)],
    ];
    if (c.evaluation) items.push(['Evaluation', describe(c.evaluation)]);
    if (c.secure_aggregation) items.push(['Secure aggregation', describe(c.secure_aggregation)]);
    if (c.differential_privacy) items.push(['Differential privacy', describe(c.differential_privacy)]);
    if (c.asynchronous) items.push(['Asynchronous', describe(c.asynchronous)]);
    if (task.open_round) {
      const o = task.open_round;
      items.push(['Open round', `${o.round}, attempt ${o.attempt + 1}${o.stage ? `, stage ${o.stage.replace('_', ' ')}` : ''}: ${o.accepted} of ${o.selected} selected clients uploaded; deadline ${fmtTime(o.deadline_unix_ms)}`]);
    }
    if (task.ended_reason) items.push(['Ended', task.ended_reason]);
    config.replaceChildren(...items.flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]));
  }

  function renderCharts() {
    const all = sorted().filter((r) => r.outcome.status === 'published');
    const x = all.map((r) => r.round);
    charts.loss.set([x, all.map((r) => r.metrics.loss ?? null)]);
    charts.evaluation.set([x, all.map((r) => r.evaluation?.loss ?? null), all.map((r) => r.evaluation?.accuracy ?? null)]);
    charts.privacy.figure.hidden = !task?.config.differential_privacy;
    charts.privacy.set([x, all.map((r) => r.privacy?.epsilon ?? null)]);
    const histogram = [];
    for (const r of all) {
      (r.staleness?.histogram || []).forEach((n, s) => { histogram[s] = (histogram[s] || 0) + n; });
    }
    charts.staleness.figure.hidden = !task?.config.asynchronous;
    charts.staleness.set([histogram.map((_, s) => s), histogram.map((n) => n || 0)]);
  }

  function renderTable() {
    const newest = sorted().reverse();
    const pages = Math.max(1, Math.ceil(newest.length / TABLE_ROWS));
    page = Math.min(page, pages - 1);
    const shown = newest.slice(page * TABLE_ROWS, (page + 1) * TABLE_ROWS);
    rows.replaceChildren(...shown.map((r) => {
      const published = r.outcome.status === 'published';
      const participants = r.compacted ? r.compacted.participants : r.participants.length;
      const dropped = r.compacted ? r.compacted.dropped : r.dropped.length;
      return h('tr', {},
        h('th', { scope: 'row', class: 'num' }, r.attempt ? `${r.round} (attempt ${r.attempt + 1})` : r.round),
        h('td', {}, published ? 'published' : `abandoned: ${r.outcome.reason}`),
        h('td', { class: 'num', title: r.participants.join(', ') || undefined }, participants),
        h('td', { class: 'num', title: r.dropped.join(', ') || undefined }, dropped),
        h('td', { class: 'num' }, r.examples),
        h('td', { class: 'num' }, `${(r.duration_ms / 1000).toFixed(1)} s`),
        h('td', { class: 'num' }, num(r.metrics.loss)),
        h('td', { class: 'num' }, num(r.evaluation?.accuracy)),
        h('td', { class: 'num' }, r.privacy ? r.privacy.epsilon.toFixed(3) : '—'),
        h('td', {}, published && !r.pruned
          ? h('a', { href: `/admin/v1/tasks/${id}/rounds/${r.round}/model`, download: `${id}-round-${r.round}.safetensors` }, 'download')
          : r.pruned ? 'pruned' : '—'));
    }));
    pager.replaceChildren(
      h('button', { type: 'button', disabled: page === 0, onclick: () => { page -= 1; renderTable(); } }, 'Newer'),
      h('span', { class: 'muted' }, `Page ${page + 1} of ${pages} · ${newest.length} entries${loadingOlder ? ' (loading older rounds…)' : ''}`),
      h('button', { type: 'button', disabled: page >= pages - 1, onclick: () => { page += 1; renderTable(); } }, 'Older'));
  }

  function add(records) {
    for (const r of records) entries.set(`${r.round}.${r.attempt}`, r);
  }

  // Rounds after `after` (up to `upto`), in pages.
  async function fetchRange(after, upto) {
    let from = after;
    for (;;) {
      const page = await api('GET', `/admin/v1/tasks/${id}/rounds?after=${from}&limit=${HISTORY_PAGE}`);
      const wanted = upto === undefined ? page : page.filter((r) => r.round <= upto);
      add(wanted);
      if (page.length < HISTORY_PAGE || wanted.length < page.length) return;
      from = page[page.length - 1].round;
    }
  }

  async function loadOlder() {
    if (!oldestLoaded || oldestLoaded <= 1) return;
    const upto = oldestLoaded;
    oldestLoaded = 1;
    loadingOlder = fetchRange(0, upto - 1);
    renderTable();
    await loadingOlder;
    loadingOlder = null;
    renderCharts();
    renderTable();
  }

  let fetching = null;
  let again = false; // an event came while a refresh ran: refresh once more after it
  async function refresh() {
    // The latest rounds again (an evaluation ends after its round published), and any new.
    const newest = sorted().pop();
    const after = newest ? Math.max(0, newest.round - 3) : Math.max(0, (task?.published_rounds || 0) - HISTORY_FIRST);
    if (oldestLoaded === null) oldestLoaded = after + 1;
    await fetchRange(after);
    renderCharts();
    renderTable();
  }

  function render(tasks) {
    const now = tasks.find((t) => t.config.id === id);
    if (!now) {
      status.textContent = `No task ${id}.`;
      return;
    }
    task = now;
    renderHeader();
    const run = () => {
      fetching = refresh().catch((e) => { status.textContent = e.message; }).finally(() => {
        fetching = null;
        if (again) {
          again = false;
          run();
        }
      });
    };
    if (fetching) again = true;
    else run();
  }

  app.view = { render, close: () => Object.values(charts).forEach((c) => c.close()) };
  (async () => {
    try {
      task = await api('GET', `/admin/v1/tasks/${id}`);
    } catch (e) {
      status.textContent = e.status === 404 ? `No task ${id}.` : e.message;
      return;
    }
    renderHeader();
    await refresh();
    // Milliseconds from the navigation's start to the first frame with the latest rounds drawn,
    // and to the one with the whole history (the benchmark reads them).
    requestAnimationFrame(() => { document.body.dataset.rendered = String(performance.now()); });
    try {
      await loadOlder();
      requestAnimationFrame(() => { document.body.dataset.complete = String(performance.now()); });
    } catch (e) {
      status.textContent = e.message;
    }
  })();
}

// ---- Clients ------------------------------------------------------------------------------

function clientsPage() {
  const body = h('tbody');
  const status = h('p', { 'aria-live': 'polite', class: 'muted' });
  const dialog = h('dialog', { 'aria-labelledby': 'revoke-title' });
  const taskChoices = h('fieldset', {}, h('legend', {}, 'Tasks the client may use (none ticked: every task)'));
  const ttl = h('input', { id: 'ttl', type: 'number', min: 1, max: 8760, value: 24 });
  const tokenOut = h('div', { 'aria-live': 'polite' });
  const form = h('form', { class: 'panel', 'aria-labelledby': 'enrol-title' },
    h('h2', { id: 'enrol-title' }, 'Issue an enrolment token'),
    taskChoices,
    h('label', { for: 'ttl' }, 'Valid for (hours)'), ttl, ' ',
    h('button', { class: 'primary', type: 'submit' }, 'Issue token'),
    tokenOut);
  show(h('h1', {}, 'Clients'), status, dialog,
    h('div', { class: 'table-wrap' }, h('table', { id: 'clients' },
      h('caption', {}, 'Enrolled clients'),
      h('thead', {}, h('tr', {}, ['Client', 'Label', 'Tasks', 'Enrolled', 'Last seen', 'Contributions', 'Strikes', 'State', ''].map((c) => h('th', { scope: 'col' }, c)))),
      body)),
    form);

  for (const t of app.tasks) {
    const box = h('input', { type: 'checkbox', id: `task-${t.config.id}`, value: t.config.id });
    taskChoices.append(h('div', {}, box, ' ', h('label', { for: `task-${t.config.id}`, class: 'inline' }, t.config.id)));
  }

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const tasks = [...taskChoices.querySelectorAll('input:checked')].map((b) => b.value);
    try {
      const t = await api('POST', '/admin/v1/enrolments', {
        ttl_secs: Math.round(Number(ttl.value) * 3600),
        ...(tasks.length ? { tasks } : {}),
      });
      const out = h('input', { class: 'token', id: 'enrolment-token', readonly: true, value: t.token, 'aria-label': 'Enrolment token' });
      const copy = h('button', { type: 'button' }, 'Copy');
      copy.addEventListener('click', async () => {
        out.select();
        try {
          await navigator.clipboard.writeText(t.token);
          copy.textContent = 'Copied';
        } catch (_) {
          copy.textContent = 'Selected: copy with Ctrl+C';
        }
      });
      tokenOut.replaceChildren(
        h('p', {}, `Shown once: give it to the client (hora-client enrol), valid until ${fmtTime(t.expires_unix_ms)}.`),
        h('div', { class: 'actions' }, out, copy));
    } catch (e) {
      tokenOut.replaceChildren(h('p', { class: 'error' }, e.message));
    }
  });

  async function load() {
    const clients = await api('GET', '/admin/v1/clients');
    body.replaceChildren(...clients.map((c) => h('tr', {},
      h('th', { scope: 'row' }, c.client_id),
      h('td', {}, c.label || '—'),
      h('td', {}, c.tasks ? c.tasks.join(', ') : 'every task'),
      h('td', {}, fmtTime(c.enrolled_unix_ms)),
      h('td', {}, ago(c.last_seen_unix_ms)),
      h('td', { class: 'num' }, c.contributions),
      h('td', { class: 'num' }, c.strikes),
      h('td', {}, c.revoked ? h('span', { class: 'badge state-stopped' }, 'revoked')
        : c.quarantined ? h('span', { class: 'badge state-paused', title: c.quarantined }, 'quarantined') : h('span', { class: 'badge state-running' }, 'active')),
      h('td', {}, c.revoked ? '' : h('button', {
        type: 'button', class: 'danger', 'aria-label': `Revoke ${c.client_id}`,
        onclick: () => {
          dialog.replaceChildren(
            h('h2', { id: 'revoke-title' }, `Revoke client ${c.client_id}?`),
            h('p', {}, 'Its credentials stop working at once; it must enrol again with a new token.'),
            h('div', { class: 'actions' },
              h('button', { type: 'button', class: 'danger', onclick: async () => {
                dialog.close();
                try {
                  await api('POST', `/admin/v1/clients/${c.client_id}/revoke`);
                  status.textContent = `Client ${c.client_id} revoked.`;
                  load();
                } catch (e) { status.textContent = e.message; }
              } }, 'Revoke'),
              h('button', { type: 'button', onclick: () => dialog.close() }, 'Cancel')));
          dialog.showModal();
        },
      }, 'Revoke')))));
  }
  app.view = { render: () => {} };
  load().catch((e) => { status.textContent = e.message; });
}

// ---- Sync jobs ----------------------------------------------------------------------------

function syncPage() {
  const body = h('tbody');
  const status = h('p', { 'aria-live': 'polite', class: 'muted' });
  const worlds = h('div', { id: 'sync-worlds' });
  show(h('h1', {}, 'Sync jobs'), status,
    h('div', { class: 'table-wrap' }, h('table', { id: 'sync-jobs' },
      h('caption', {}, 'Synchronous allreduce jobs'),
      h('thead', {}, h('tr', {}, ['Job', 'World size', 'Worlds formed', 'Waiting', 'State'].map((c) => h('th', { scope: 'col' }, c)))),
      body)),
    worlds);
  // A table of ranks and their ring addresses.
  const members = (caption, list) => h('div', { class: 'table-wrap' }, h('table', {},
    h('caption', {}, caption),
    h('thead', {}, h('tr', {}, h('th', { scope: 'col' }, 'Rank'), h('th', { scope: 'col' }, 'Ring address'))),
    h('tbody', {}, list.map((m) => h('tr', {}, h('th', { scope: 'row', class: 'num' }, m.rank), h('td', {}, m.address))))));
  async function load() {
    const jobs = await api('GET', '/admin/v1/sync-jobs');
    body.replaceChildren(...(jobs.length ? jobs.map((j) => h('tr', {},
      h('th', { scope: 'row' }, j.id),
      h('td', { class: 'num' }, j.world_size),
      h('td', { class: 'num' }, j.generations),
      h('td', { class: 'num' }, `${j.waiting} of ${j.world_size}`),
      h('td', {}, j.waiting ? 'forming a world' : j.generations ? 'formed' : 'no worker yet'))) : [h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No sync jobs.'))]));
    worlds.replaceChildren(...jobs.flatMap((j) => [
      j.members?.length ? members(`${j.id}: waiting in the world being formed`, j.members) : null,
      j.formed ? members(`${j.id}: world ${j.formed.generation}, formed ${fmtTime(j.formed.formed_unix_ms)}`, j.formed.members) : null,
    ]).filter(Boolean));
  }
  app.view = { render: () => load().catch(() => {}) };
  load().catch((e) => { status.textContent = e.message; });
}

// ---- Start --------------------------------------------------------------------------------

// A sign-in link (`#sign-in=CODE`), opened now or followed from this page: the code is posted,
// and leaves the address bar and the history. False if the address is no such link.
function signInByLink() {
  const link = location.hash.match(/^#sign-in=([0-9a-f]{1,128})$/);
  if (!link) return false;
  history.replaceState(null, '', '#/');
  api('POST', '/dashboard/api/session', { link: link[1] }).then(startSession, (e) => {
    signInPage(e.status === 401 ? 'That sign-in link was used already or has expired: sign in with the admin token.' : e.message);
  });
  return true;
}

async function start() {
  document.getElementById('sign-out').addEventListener('click', signOut);
  window.addEventListener('hashchange', () => { if (!signInByLink()) route(); });
  if (signInByLink()) return;
  try {
    startSession(await api('GET', '/dashboard/api/session'));
  } catch (_) {
    signInPage('');
  }
}

start();

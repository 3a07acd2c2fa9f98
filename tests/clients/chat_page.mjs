// The chat page of `dejavu serve` in headless Chromium, driven by playwright-core (no browser
// download: the system's Chromium). It checks the model name in the header; sets max tokens,
// temperature and a system prompt in the settings and reads them back from the request the page
// sends; types a message, presses Enter, watches the reply grow chunk by chunk; renders a
// markdown sample (markup of the model's must come out escaped); toggles the theme; stops a
// reply mid-stream (the network throttled so that it is still streaming) and sends again; and
// saves a screenshot.
//
//   node tests/clients/chat_page.mjs http://127.0.0.1:8080/ out.png
//
// Prints one JSON line: {"reply", "updates", "class", "model", "checks": {name: bool}}. Exits
// non-zero if the page shows an error, gives no reply within 60 s, or a check fails.
import { chromium } from 'playwright-core';

const [url, out] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
const checks = {};
try {
  const page = await browser.newPage({ viewport: { width: 900, height: 640 }, colorScheme: 'light' });
  const bodies = [];
  page.on('request', (r) => {
    if (r.url().endsWith('/v1/chat/completions')) bodies.push(JSON.parse(r.postData()));
  });
  await page.goto(url);
  // The model name, as /v1/models lists it.
  await page.waitForFunction(() => document.getElementById('model').textContent !== '', null, { timeout: 10000 });
  const model = await page.locator('#model').textContent();
  const listed = await page.evaluate(async () => (await (await fetch('/v1/models')).json()).data[0].id);
  checks.model_name = model === listed;

  // Settings go into the request.
  await page.locator('#settings summary').click();
  await page.locator('#max-tokens').fill('24');
  await page.locator('#temperature').fill('0');
  await page.locator('#system').fill('You are brief.');
  // Count the reply's text changes as the stream arrives.
  await page.evaluate(() => {
    window.updates = 0;
    new MutationObserver(() => {
      const box = document.querySelector('#log .assistant, #log .error');
      if (box && box.textContent !== '…') window.updates++;
    }).observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true });
  });
  const idle = () => page.waitForFunction(() => {
    const box = document.querySelector('#log .msg:last-child');
    return document.getElementById('send').disabled === false && box && !box.classList.contains('user');
  }, null, { timeout: 60000 });
  await page.locator('#input').pressSequentially('Tell me a story about a lighthouse.', { delay: 5 });
  await page.locator('#input').press('Enter');
  await idle();
  const box = page.locator('#log .msg:last-child');
  const cls = await box.getAttribute('class');
  const reply = await box.textContent();
  const b = bodies[0] || {};
  checks.settings = b.max_tokens === 24 && b.temperature === 0 && b.stream === true
    && b.messages[0].role === 'system' && b.messages[0].content === 'You are brief.'
    && b.messages[1].content === 'Tell me a story about a lighthouse.';

  // Markdown, with the model's own markup escaped and only http(s) links.
  const html = await page.evaluate(() => window.renderMarkdown(
    '# Title\n**bold** and `code` and *it*\n- one\n- two\n\n```\n<script>alert(1)</script>\n```\n'
    + '[bad](javascript:alert(1)) [good](https://example.org) <img src=x onerror=alert(1)>'));
  checks.markdown = html.includes('<h3>Title</h3>') && html.includes('<strong>bold</strong>')
    && html.includes('<code>code</code>') && html.includes('<em>it</em>')
    && html.includes('<ul><li>one</li><li>two</li></ul>')
    && html.includes('&lt;script&gt;alert(1)&lt;/script&gt;') && !html.includes('<script')
    && !html.includes('<img') && !html.includes('href="javascript')
    && html.includes('href="https://example.org"');

  // The theme toggles and is remembered.
  await page.locator('#theme').click();
  const theme = await page.evaluate(() => [document.documentElement.dataset.theme, localStorage.getItem('theme')]);
  checks.theme = theme[0] === 'dark' && theme[1] === 'dark';
  await page.screenshot({ path: out, fullPage: true });

  // Stop mid-stream: the network throttled so a long reply is still arriving when Stop is
  // clicked; what came stays, marked, and the next message goes out.
  const cdp = await page.context().newCDPSession(page);
  await cdp.send('Network.emulateNetworkConditions',
    { offline: false, latency: 100, downloadThroughput: 1500, uploadThroughput: 1e6 });
  await page.locator('#max-tokens').fill('200');
  await page.locator('#temperature').fill('1');
  await page.locator('#input').fill('And another one, a long one.');
  await page.locator('#input').press('Enter');
  await page.waitForFunction(() => {
    const box = document.querySelector('#log .msg:last-child');
    return box && box.classList.contains('assistant') && box.textContent !== '…';
  }, null, { timeout: 30000 });
  await page.locator('#stop').click();
  await idle();
  const stopped = await page.locator('#log .msg:last-child').getAttribute('class');
  checks.stop = stopped.includes('stopped') && !(await page.locator('#stop').isVisible());
  await cdp.send('Network.emulateNetworkConditions',
    { offline: false, latency: 0, downloadThroughput: -1, uploadThroughput: -1 });
  await page.locator('#max-tokens').fill('4');
  await page.locator('#input').fill('Thanks.');
  await page.locator('#input').press('Enter');
  await idle();
  const last = bodies[bodies.length - 1];
  const after = await page.locator('#log .msg:last-child').getAttribute('class');
  // The stopped reply is part of the conversation the next request sends.
  checks.after_stop = !after.includes('error') && last.messages.length === 6
    && last.messages[4].role === 'assistant';

  const updates = await page.evaluate(() => window.updates);
  console.log(JSON.stringify({ reply, updates, class: cls, model, checks }));
  const failed = Object.entries(checks).filter(([, ok]) => !ok);
  if (cls.includes('error') || !reply || reply === '…' || failed.length) process.exitCode = 1;
} finally {
  await browser.close();
}

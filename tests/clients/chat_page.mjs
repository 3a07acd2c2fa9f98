// The chat page of `dejavu serve` in headless Chromium, driven by playwright-core (no browser
// download: the system's Chromium). It types a message, presses Enter, watches the reply grow
// chunk by chunk, and saves a screenshot.
//
//   node tests/clients/chat_page.mjs http://127.0.0.1:8080/ out.png
//
// Prints one JSON line: {"reply": ..., "updates": N} (N: times the reply's text changed while
// it streamed). Exits non-zero if the page shows an error or no reply within 60 s.
import { chromium } from 'playwright-core';

const [url, out] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
try {
  const page = await browser.newPage({ viewport: { width: 900, height: 640 } });
  await page.goto(url);
  // Count the reply's text changes as the stream arrives.
  await page.evaluate(() => {
    window.updates = 0;
    new MutationObserver(() => {
      const box = document.querySelector('#log .assistant, #log .error');
      if (box && box.textContent !== '…') window.updates++;
    }).observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true });
  });
  await page.locator('#input').pressSequentially('Tell me a story about a lighthouse.', { delay: 5 });
  await page.locator('#input').press('Enter');
  await page.waitForFunction(() => {
    const box = document.querySelector('#log .msg:last-child');
    return document.getElementById('send').disabled === false && box && !box.classList.contains('user');
  }, null, { timeout: 60000 });
  const box = page.locator('#log .msg:last-child');
  const cls = await box.getAttribute('class');
  const reply = await box.textContent();
  await page.screenshot({ path: out, fullPage: true });
  const updates = await page.evaluate(() => window.updates);
  console.log(JSON.stringify({ reply, updates, class: cls }));
  if (cls.includes('error') || !reply || reply === '…') process.exitCode = 1;
} finally {
  await browser.close();
}

#!/usr/bin/env python3
"""Take the README's picture of the playground (chapter 14j): serve SmolLM2, ask it two questions in headless Chromium,
save the page as `nbs/images/playground.png`. Needs Debian's chromium and Playwright (the dev extra); usage:
`python scripts/playground_screenshot.py [OUT.png]`."""
import shutil, sys
from pathlib import Path
from playwright.sync_api import sync_playwright
from nanoserve.testing import ServerProcess

QUESTIONS = ['What is the capital of France?', 'And what is it famous for?']
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                 '--disable-sync', '--no-first-run']
REPLY_DONE = ("() => { const m = document.querySelectorAll('.msg.assistant');"
              " return m.length && m[m.length - 1].getAttribute('data-state') === 'done'; }")

def main(out: str = 'nbs/images/playground.png'):
    with ServerProcess('smollm2', cli=True, served_model_name='smollm2') as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which('chromium'), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={'width': 1280, 'height': 760})
        page.goto(server.url + '/')
        page.wait_for_selector('#model option[value="smollm2"]', state='attached', timeout=60_000)
        page.fill('#system', 'You are a helpful assistant.')
        page.fill('#temperature', '0')
        page.fill('#max_tokens', '60')
        for question in QUESTIONS:
            page.fill('#prompt', question)
            page.click('#send')
            page.wait_for_function(REPLY_DONE, timeout=120_000)
        page.wait_for_timeout(2500)       # the metrics panel's next reads
        page.screenshot(path=str(Path(out)))
        browser.close()
    print('saved', out)

if __name__ == '__main__': main(*sys.argv[1:])

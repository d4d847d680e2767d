"""The playground page (chapter 14j) against a real server on a tiny model, with an API key: served open at `/` while
its API still asks for the key, absent with `--no-ui`, shipped in the wheel; and in a real browser (headless
Chromium driven by Playwright), the answer it streams equals the chat completions route's greedy text for the same
messages and knobs, JSON mode answers JSON that fits the schema, Stop aborts the generation on the server, the
metrics panel counts the tokens (and a server of replicas' gauges), a refused request shows the server's message, a
reasoning parser's thinking is shown apart, behind a proxy's prefix the page calls the API under it, and no request
leaves for another host. Without Chromium or Playwright the browser tests skip, saying
why."""
import json, re, shutil, subprocess, sys, zipfile
from pathlib import Path
import httpx
import jsonschema
import pytest
from nanoserve.server.frontend import ServerMetrics
from nanoserve.server.playground import playground_page
from nanoserve.testing import ServerProcess, save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
ENGINE = dict(device='cpu', page_size=4, num_pages=256, max_num_batched_tokens=16)
KEY = 'sk-playground-test'
AUTH = {'Authorization': f'Bearer {KEY}'}
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                 '--disable-sync', '--no-first-run']
WAIT_MS = 120_000        # how long a browser wait may take before it fails: generous, the machine is shared

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model_dir):
    with ServerProcess(model_dir, served_model_name='tiny', api_key=KEY, debug_hooks=True, **ENGINE) as s: yield s

def chat(server, body: dict, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(f'{server.url}/v1/chat/completions', json=body, headers=headers, timeout=120)

def metric(server, name: str) -> float:
    "One of the server's Prometheus counters or gauges, summed over its labels."
    text = httpx.get(f'{server.url}/metrics', timeout=30).text
    return sum(float(value) for value in re.findall(rf'^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$', text, flags=re.M))

# -- without a browser -------------------------------------------------------------------------------------------------
def test_page_is_open_and_its_api_is_not(server):
    r = httpx.get(server.url + '/', timeout=30)
    assert r.status_code == 200 and r.headers['content-type'] == 'text/html; charset=utf-8', r.headers
    assert r.text == playground_page() and '<title>nanoserve playground</title>' in r.text
    head = httpx.head(server.url + '/', timeout=30)                              # a probe's question
    assert head.status_code == 200 and head.headers['content-type'] == r.headers['content-type'] and not head.content
    policy = r.headers['content-security-policy']
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy, policy
    body = {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stream': True}
    for headers in ({}, {'Authorization': 'Bearer sk-wrong'}):                # what the page sends without the key
        refused = chat(server, body, headers)
        assert refused.status_code == 401 and refused.json()['error']['code'] == 'invalid_api_key', refused.text
        assert httpx.get(server.url + '/v1/models', headers=headers, timeout=30).status_code == 401
    assert chat(server, body).status_code == 200

def test_no_ui_flag_serves_no_page(model_dir):
    with ServerProcess(model_dir, cli=True, served_model_name='tiny', ui=False, **ENGINE) as s:   # `--no-ui`
        assert '--no-ui' in s.command()
        r = httpx.get(s.url + '/', timeout=30)
        assert r.status_code == 404 and 'error' in r.json(), r.text
        assert httpx.get(s.url + '/v1/models', timeout=30).json()['data'][0]['id'] == 'tiny'

def test_the_wheel_ships_the_page(tmp_path):
    source = tmp_path / 'src'                                   # a copy: the build leaves nothing in the checkout
    shutil.copytree(ROOT / 'nanoserve', source / 'nanoserve', ignore=shutil.ignore_patterns('__pycache__'))
    for name in ('setup.py', 'settings.ini', 'pyproject.toml', 'README.md'): shutil.copy(ROOT / name, source / name)
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '--no-index', '-q',
                        '-w', str(tmp_path / 'dist'), str(source)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with zipfile.ZipFile(next((tmp_path / 'dist').glob('nanoserve-*.whl'))) as wheel:
        assert wheel.read('nanoserve/server/playground.html').decode() == playground_page()

# -- in a browser ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def browser():
    chromium = shutil.which('chromium')
    if chromium is None:
        pytest.skip("no browser: `chromium` is not on PATH (Debian's chromium package; .ci/run installs it as root)")
    sync_api = pytest.importorskip('playwright.sync_api', reason='playwright is not installed (a dev requirement)')
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()

class Playground:
    "The page in a fresh browser context (no stored key); every URL it requests, its script errors and CSP refusals."
    def __init__(self, browser, server, prefix: str = ''):     # a prefix: behind a proxy that serves it there
        self.base, self.urls, self.errors = f'{server.url}{prefix}/', [], []
        self.context = browser.new_context(viewport={'width': 1280, 'height': 820})
        if prefix:      # the proxy, as nginx's `location /nano/ { proxy_pass http://server/; }`
            def strip(route):
                route.fulfill(response=route.fetch(url=route.request.url.replace(self.base, server.url + '/')))
            self.context.route(self.base + '**', strip)
        self.context.on('request', lambda request: self.urls.append(request.url))
        self.page = self.context.new_page()
        self.page.on('pageerror', lambda error: self.errors.append(str(error)))
        self.page.on('console', lambda m: 'Content Security Policy' in m.text and self.errors.append(m.text))
        self.page.set_default_timeout(WAIT_MS)
        self.page.goto(self.base)

    def set_key(self, key: str):
        self.page.fill('#key', key)
        self.page.press('#key', 'Tab')                          # a change: the models are asked for again
        self.page.wait_for_selector('#model option[value="tiny"]', state='attached')

    def set_knobs(self, **knobs):
        for name, value in knobs.items(): self.page.fill(f'#{name}', str(value))

    def ask(self, text: str):
        "Send `text`; the request the page made, and its answer's element once the stream has ended."
        self.page.fill('#prompt', text)
        with self.page.expect_request(lambda r: r.url.endswith('/v1/chat/completions')) as sent:
            self.page.click('#send')
        reply = self.page.locator('.msg.assistant').last
        self.page.wait_for_function("e => e.dataset.state !== 'streaming'", arg=reply.element_handle())
        return sent.value, reply

    def text(self, selector: str) -> str: return self.page.locator(selector).text_content()

    def close(self):
        """Close the context, after checking that every request went to the server, under the page's prefix (data:
        URLs stay in the page), that the page broke no rule of its policy (a fetch elsewhere is refused before it is a
        request) and that it threw no error."""
        self.context.close()
        local = (self.base, 'data:')
        foreign = [url for url in self.urls if not url.startswith(local)]
        assert self.urls and not foreign and not self.errors, (foreign, self.errors)

@pytest.fixture
def playground(browser, server):
    pg = Playground(browser, server)
    yield pg
    pg.close()

def test_streamed_answers_are_the_greedy_replies_and_the_panel_counts_them(playground, server, tmp_path):
    page = playground.page
    playground.set_key(KEY)
    assert page.evaluate("localStorage.getItem('nanoserve.apiKey')") == KEY
    page.fill('#system', 'You are a terse assistant.')
    playground.set_knobs(temperature=0, top_p=1, max_tokens=12, seed='')
    page.wait_for_function("() => !isNaN(parseFloat(document.getElementById('m-gen').textContent))")   # polled once
    knobs = {'model': 'tiny', 'temperature': 0, 'top_p': 1, 'max_tokens': 12}
    messages = [{'role': 'system', 'content': 'You are a terse assistant.'}]
    for question in ('What is the capital of France?', 'And of Italy?'):
        request, reply = playground.ask(question)
        assert reply.get_attribute('data-state') == 'done', playground.text('#error')
        messages.append({'role': 'user', 'content': question})
        sent = request.post_data_json
        assert request.headers['authorization'] == f'Bearer {KEY}'
        assert sent['stream'] is True and 'seed' not in sent and sent == {**sent, **knobs, 'messages': messages}
        expected = chat(server, {**knobs, 'messages': messages}).json()          # the same request, not streamed
        answer = reply.locator('.content').text_content()
        assert answer == expected['choices'][0]['message']['content'] and answer, (answer, expected)
        assert int(reply.get_attribute('data-deltas')) >= 2                       # rendered delta by delta
        assert f"{expected['usage']['completion_tokens']} tokens" in reply.locator('.meta').text_content()
        messages.append({'role': 'assistant', 'content': answer})                 # the next turn sends it back
    generated = metric(server, 'nanoserve:generation_tokens_total')              # nothing else is generating now
    page.wait_for_function('n => Number(document.getElementById("m-gen").textContent) === n', arg=generated)
    page.wait_for_function("() => parseFloat(document.getElementById('m-peak').textContent) > 0")   # chart's tokens/s
    assert page.locator('.msg').count() == 4
    page.screenshot(path=str(tmp_path / 'playground.png'))
    page.click('#clear')
    assert page.locator('.msg').count() == 0

def test_json_schema_mode_answers_json_that_fits(playground, server):
    schema = {'title': 'tally', 'type': 'object', 'additionalProperties': False, 'required': ['count', 'done'],
              'properties': {'count': {'type': 'integer'}, 'done': {'type': 'boolean'}}}
    playground.set_key(KEY)
    playground.set_knobs(temperature=0, max_tokens=48)
    playground.page.check('#json_mode')
    playground.page.fill('#schema', json.dumps(schema, indent=2))
    request, reply = playground.ask('Count to three.')
    assert reply.get_attribute('data-state') == 'done', playground.text('#error')
    assert request.post_data_json['response_format'] == {'type': 'json_schema',
                                                         'json_schema': {'name': 'tally', 'schema': schema}}
    answer = reply.locator('.content').text_content()
    jsonschema.validate(json.loads(answer), schema)
    body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Count to three.'}], 'temperature': 0,
            'top_p': 1, 'max_tokens': 48, 'response_format': request.post_data_json['response_format']}
    assert answer == chat(server, body).json()['choices'][0]['message']['content']
    playground.page.fill('#schema', '{"type": ')                 # not JSON: refused in the page, nothing sent
    playground.page.fill('#prompt', 'Again.')
    playground.page.click('#send')
    assert playground.text('#error').startswith('schema: not valid JSON')
    assert playground.page.locator('.msg').count() == 2 and playground.page.input_value('#prompt') == 'Again.'

def test_refusals_show_the_servers_message(playground, server):
    page = playground.page
    page.wait_for_function("() => document.getElementById('error').textContent.includes('401')")   # the models, keyless
    page.fill('#prompt', 'Hello?')
    page.click('#send')
    page.wait_for_function("() => document.getElementById('error').textContent.startsWith('401: a valid API key')")
    assert page.locator('.msg').count() == 0 and page.input_value('#prompt') == 'Hello?'   # the turn taken back
    playground.set_key(KEY)
    playground.set_knobs(temperature=-1)
    page.click('#send')
    expected = chat(server, {'messages': [{'role': 'user', 'content': 'Hello?'}], 'temperature': -1}).json()['error']
    page.wait_for_function("() => document.getElementById('error').textContent.startsWith('400: ')")
    assert playground.text('#error') == f"400: {expected['message']}" and 'temperature' in expected['message']
    playground.set_knobs(temperature=0, max_tokens=20)
    server.inject(fail_detokenize=3)             # the next request fails past its third token: an error event
    with page.expect_response(lambda r: r.url.endswith('/v1/chat/completions')) as response:
        page.click('#send')
    assert response.value.status == 200                                          # the stream had begun
    page.wait_for_function("() => document.getElementById('error').textContent.includes('detokeniz')")
    assert page.locator('.msg').count() == 0 and page.input_value('#prompt') == 'Hello?'

def test_stop_aborts_the_generation_on_the_server(playground, server):
    playground.set_key(KEY)
    playground.set_knobs(temperature=0, max_tokens=400)
    aborted = metric(server, 'nanoserve:num_aborted_requests_total')
    server.inject(step_delay=0.05)                               # a slow engine: Stop comes long before the end
    try:
        page = playground.page
        page.fill('#prompt', 'Tell me a long story.')
        page.click('#send')
        reply = page.locator('.msg.assistant').last
        page.wait_for_function("e => Number(e.dataset.deltas) >= 2", arg=reply.element_handle())
        page.click('#stop')
        page.wait_for_function("e => e.dataset.state === 'stopped'", arg=reply.element_handle())
    finally: server.inject(step_delay=0.0)
    assert 'stopped' in reply.get_attribute('class') and not page.is_disabled('#send')
    for _ in range(600):                                         # the server notices the disconnect and aborts
        if metric(server, 'nanoserve:num_aborted_requests_total') > aborted: break
        page.wait_for_timeout(100)
    assert metric(server, 'nanoserve:num_aborted_requests_total') == aborted + 1
    partial = reply.locator('.content').text_content()
    body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Tell me a long story.'}], 'temperature': 0,
            'top_p': 1, 'max_tokens': 400}
    full = chat(server, body).json()['choices'][0]['message']['content']
    assert partial and full.startswith(partial) and len(partial) < len(full), (partial, full)

def test_reasoning_is_shown_apart_and_not_sent_back(browser, model_dir):
    """deepseek_r1's parser: a reply whose thought never closes is all thinking, sent as `reasoning_content` deltas.
    Behind a proxy that serves the server under /nano (its root path), the page there calls the API there."""
    with ServerProcess(model_dir, served_model_name='tiny', reasoning_parser='deepseek_r1', root_path='/nano',
                       **ENGINE) as s:
        pg = Playground(browser, s, '/nano')
        try:
            pg.set_knobs(temperature=0, max_tokens=10)
            _, reply = pg.ask('Think first.')
            assert reply.get_attribute('data-state') == 'done', pg.text('#error')
            body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Think first.'}], 'temperature': 0,
                    'top_p': 1, 'max_tokens': 10}
            expected = chat(s, body, {}).json()['choices'][0]['message']
            assert reply.locator('.reasoning').text_content() == expected['reasoning_content'] != ''
            assert reply.locator('.content').text_content() == (expected['content'] or '')
            request, _ = pg.ask('Go on.')
            assert request.post_data_json['messages'][1] == {'role': 'assistant', 'content': expected['content'] or ''}
        finally: pg.close()

def test_the_panel_adds_up_replicas_counts_and_averages_their_fractions(browser, server):
    "What a server of replicas serves at /metrics (chapter 17): each replica's own metrics, under a `replica` label."
    replicas = pytest.importorskip('nanoserve.replicas', reason='ray is not installed (the nanoserve[ray] extra)')
    from prometheus_client import CollectorRegistry, generate_latest
    pages = {'num_pages': 10, 'prefix_queries': 4}
    stats = {'r0': {**pages, 'running': 2, 'waiting': 1, 'free_pages': 8, 'prefix_hits': 1},
             'r1': {**pages, 'running': 3, 'waiting': 0, 'free_pages': 4, 'prefix_hits': 2}}
    reports = {name: {'metrics': ServerMetrics('tiny', lambda s=s: s).render().decode()} for name, s in stats.items()}
    registry = CollectorRegistry()
    registry.register(replicas.ReplicaCollector(lambda: reports, set()))
    text = generate_latest(registry).decode()
    assert 'replica="r1"' in text
    pg = Playground(browser, server)
    try:
        pg.page.route('**/metrics', lambda route: route.fulfill(body=text, content_type='text/plain'))
        pg.page.reload()
        pg.page.wait_for_function("() => document.getElementById('m-running').textContent === '5'")
        shown = [pg.text(f'#m-{name}') for name in ('running', 'waiting', 'kv', 'hit')]
        assert shown == ['5', '1', '40.0 %', '37.5 %'], shown       # kv: (0.2 + 0.6) / 2; hits: (1/4 + 2/4) / 2
    finally: pg.close()

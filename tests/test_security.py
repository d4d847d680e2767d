"""Who may use the server, and how much one client may take: API keys, bodies and prompts bounded before any work,
slow and idle clients beside normal traffic, a stream read slowly, TLS and a root path. Real servers (three
processes, ZMQ, uvicorn) on a tiny model with a context of 512 tokens; loopback only; every wait is bounded.

What is asserted is what happened (status codes, the requests that finished, the connections the server closed,
resident memory that did not grow past a generous slack), never how fast: times are only sanity bounds.

Size: sized for two cores. `NANOSERVE_ABUSE_SCALE=N` multiplies the oversized body (100 MB), the idle connections
(200) and the slow clients (10) by N."""
import http.client, json, os, shutil, socket, ssl, subprocess, threading, time
import httpx
import openai
import pytest
from nanoserve.server.frontend import MAX_REQUEST_BYTES
from nanoserve.testing import ServerProcess, save_tiny_model

SCALE = int(os.environ.get('NANOSERVE_ABUSE_SCALE', '1'))
ENGINE = dict(device='cpu', page_size=4, num_pages=256)   # max_model_len is the model's 512
KEYS = ['sk-test-first-3f9c2a', 'sk-test-second-81d0e7']
GUARD = dict(body_timeout=2.0, timeout_keep_alive=1.0, stream_backlog=16, root_path='/nano')
RSS_SLACK_MB = 64         # allocator noise; a body of 100 MB read whole would be far above it
SANITY_S = 60             # a bound on waits, not a speed claim

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def guarded(model_dir, tmp_path_factory):
    "A server with two keys, a 2 s body deadline, a 1 s idle timeout and a 16-token stream backlog; its log kept."
    log_path = tmp_path_factory.mktemp('logs') / 'server.log'
    with open(log_path, 'w') as log:
        s = ServerProcess(model_dir, served_model_name='tiny', api_key=KEYS, stderr=log, quiet=False, **GUARD, **ENGINE).start()
        s.log_path = log_path
        yield s
        assert s.stop() == 0

def _auth(key: str = KEYS[0]) -> dict: return {'Authorization': f'Bearer {key}'}

def _rss_mb(server) -> dict[str, float]:
    "Resident memory of the server's processes, from /proc."
    pids = {'api': server.proc.pid, **server.state()['pids']}
    def rss(pid):
        with open(f'/proc/{pid}/status') as f:
            return int(next(line for line in f if line.startswith('VmRSS:')).split()[1]) / 1024
    return {name: rss(pid) for name, pid in pids.items()}

def _assert_flat(before: dict, after: dict):
    grown = {name: round(after[name] - before[name]) for name in before}
    assert all(mb <= RSS_SLACK_MB for mb in grown.values()), f'resident memory grew (MB): {grown}'

def _envelope(r) -> dict:
    err = r.json()['error']
    assert set(err) == {'message', 'type', 'param', 'code'}, err
    return err

def _complete(server, prompt: str = 'The capital of France is', **body) -> httpx.Response:
    return httpx.post(server.url + '/v1/completions', headers=_auth(), timeout=SANITY_S,
                      json={'model': 'tiny', 'prompt': prompt, 'max_tokens': 4, 'temperature': 0, **body})

def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf: sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(SANITY_S)
    sock.connect((server.host, server.port))
    return sock

def _head(path: str, headers: dict) -> bytes:
    lines = [f'POST {path} HTTP/1.1', 'Host: test', 'Content-Type: application/json',
             *[f'{name}: {value}' for name, value in headers.items()]]
    return ('\r\n'.join(lines) + '\r\n\r\n').encode()

def _send_until_answered(server, head: bytes, chunks) -> tuple[http.client.HTTPResponse, int, bool]:
    "Send `head` then `chunks` from a thread while reading the answer: the answer, body bytes sent by then, all sent?"
    sock, sent, finished = _connect(server), [0], threading.Event()
    def pump():
        try:
            sock.sendall(head)
            for chunk in chunks:
                sock.sendall(chunk)
                sent[0] += len(chunk)
            finished.set()
        except OSError: pass                        # the server answered and closed: the rest is not wanted
    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    try:
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        answer.body = answer.read()
        return answer, sent[0], finished.is_set()
    finally:
        try: sock.shutdown(socket.SHUT_RDWR)        # unblocks the sender, if the server has not closed already
        except OSError: pass
        sock.close()
        sender.join(SANITY_S)

# -- API keys -------------------------------------------------------------------------------------------------------
def test_keys_right_wrong_missing(guarded):
    url = guarded.url
    for headers in [{}, _auth('sk-wrong'), {'Authorization': KEYS[0]}, {'Authorization': f'Basic {KEYS[0]}'}]:
        for method, path in [('GET', '/v1/models'), ('POST', '/v1/completions'), ('POST', '/v1/chat/completions'),
                             ('GET', '/debug/state')]:
            r = httpx.request(method, url + path, headers=headers, json={'model': 'tiny', 'prompt': 'hi'}, timeout=30)
            assert r.status_code == 401, (headers, path, r.text)
            err = _envelope(r)
            assert (err['type'], err['code']) == ('invalid_request_error', 'invalid_api_key'), err
            assert not any(key in r.text for key in [*KEYS, 'sk-wrong']), r.text       # no key echoed
    for key in KEYS:
        assert httpx.get(url + '/v1/models', headers=_auth(key), timeout=30).status_code == 200
    for path in ['/health', '/metrics']:                                              # open, as in vLLM
        assert httpx.get(url + path, timeout=30).status_code == 200
    good = openai.OpenAI(base_url=url + '/v1', api_key=KEYS[1], max_retries=0, timeout=SANITY_S)
    out = good.completions.create(model='tiny', prompt='The capital of France is', max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=url + '/v1', api_key='sk-wrong', max_retries=0, timeout=SANITY_S)
    with pytest.raises(openai.AuthenticationError): bad.models.list()

def test_keys_never_logged(guarded):
    httpx.get(guarded.url + '/v1/models', headers=_auth('sk-wrong'), timeout=30)
    log = guarded.log_path.read_text()
    assert '2 API key(s)' in log, log
    assert not any(key in log for key in [*KEYS, 'sk-wrong']), log

def test_root_path(guarded):
    "Behind a proxy that serves the API under /nano: the app knows its prefix, and serves the paths it is sent."
    schema = httpx.get(guarded.url + '/openapi.json', headers=_auth(), timeout=30).json()
    assert schema['servers'] == [{'url': '/nano'}], schema.get('servers')
    assert httpx.get(guarded.url + '/v1/models', headers=_auth(), timeout=30).json()['data'][0]['id'] == 'tiny'

# -- bodies and prompts ---------------------------------------------------------------------------------------------
def test_huge_body_refused_before_it_is_read(guarded):
    "A body of 100 MB (declared): 413 in the envelope, answered before it was all sent; no process grew."
    size, chunk = 100 * 2**20 * SCALE, b'x' * 2**20
    before = _rss_mb(guarded)
    start = time.monotonic()
    head = _head('/v1/completions', {**_auth(), 'Content-Length': str(size)})
    answer, sent, finished = _send_until_answered(guarded, head, (chunk for _ in range(size // len(chunk))))
    assert answer.status == 413 and answer.getheader('Connection') == 'close', (answer.status, answer.body)
    assert 'larger than' in json.loads(answer.body)['error']['message']
    assert sent < size and not finished, f'the whole body was sent ({sent} bytes) before the answer'
    assert time.monotonic() - start < SANITY_S
    _assert_flat(before, _rss_mb(guarded))
    assert _complete(guarded).status_code == 200                                       # and it serves on

def test_chunked_body_refused_once_too_large(guarded):
    "A body without a length, sent in chunks: 413 once it passes the limit, long before all of it is sent."
    size, chunk = 100 * 2**20 * SCALE, b'x' * 2**20
    before = _rss_mb(guarded)
    framed = b'%x\r\n%s\r\n' % (len(chunk), chunk)
    chunks = (framed for _ in range(size // len(chunk)))
    head = _head('/v1/completions', {**_auth(), 'Transfer-Encoding': 'chunked'})
    answer, sent, finished = _send_until_answered(guarded, head, chunks)
    assert answer.status == 413 and answer.getheader('Connection') == 'close', (answer.status, answer.body)
    assert MAX_REQUEST_BYTES < sent < size and not finished, sent
    time.sleep(0.5)                                   # the refused body is collected after the answer
    _assert_flat(before, _rss_mb(guarded))

def test_prompt_of_ten_contexts(guarded):
    "A prompt of 10x the context in characters (and one of 20 MB): 400, context_length_exceeded, nothing tokenized."
    before = _rss_mb(guarded)
    ten = 'hello ' * (10 * 512 // 6)
    r = _complete(guarded, ten)
    err = _envelope(r)
    assert (r.status_code, err['code'], err['param']) == (400, 'context_length_exceeded', 'prompt'), err
    assert 'maximum context length is 512 tokens' in err['message'] and 'characters' in err['message'], err
    r = httpx.post(guarded.url + '/v1/chat/completions', headers=_auth(), timeout=SANITY_S,
                   json={'model': 'tiny', 'messages': [{'role': 'user', 'content': ten}]})
    assert (r.status_code, _envelope(r)['code'], _envelope(r)['param']) == (400, 'context_length_exceeded', 'messages')
    start = time.monotonic()
    r = _complete(guarded, 'hello world ' * (20 * 2**20 // 12))                        # 20 MB: under the body limit
    assert (r.status_code, _envelope(r)['code']) == (400, 'context_length_exceeded'), r.text[:300]
    assert time.monotonic() - start < SANITY_S
    assert _complete(guarded).status_code == 200     # the next request: the API server lets go of the last one's text
    _assert_flat(before, _rss_mb(guarded))

def test_field_caps(guarded):
    "Lists a client could make as long as the body allows are capped, each refused by name."
    for field, value in [('stop', ['.'] * 65), ('stop', 'x' * 1001), ('stop_token_ids', list(range(65))),
                         ('n', 129), ('prompt', ['a'] * 2049), ('logit_bias', {str(i): 1 for i in range(1000)})]:
        r = _complete(guarded, **{'prompt': 'hi', field: value})
        assert (r.status_code, _envelope(r)['param']) == (400, field), (field, r.text[:300])

# -- slow and idle clients ------------------------------------------------------------------------------------------
def test_slow_and_idle_clients_beside_normal_traffic(guarded):
    """Clients that send their body, or their headers, a byte at a time, and connections that send nothing, do not keep
    normal requests from finishing; the server ends them: a 408 for each slow body, a close for the others."""
    before = _rss_mb(guarded)
    idle = [_connect(guarded) for _ in range(200 * SCALE)]
    slow = [_connect(guarded) for _ in range(10 * SCALE)]
    slow_headers = [_connect(guarded) for _ in range(5 * SCALE)]
    for sock in slow: sock.sendall(_head('/v1/completions', {**_auth(), 'Content-Length': '1000'}) + b'{"prompt": ')
    for sock in slow_headers: sock.sendall(b'POST /v1/completions HTTP/1.1\r\nX-Slow: ')
    stop = threading.Event()
    def trickle():
        while not stop.is_set():
            for sock in slow + slow_headers:
                try: sock.send(b'a' if sock in slow_headers else b' ')
                except OSError: pass
            time.sleep(0.3)
    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        answers = [_complete(guarded, f'Request {i}:').status_code for i in range(8)]
        assert answers == [200] * 8, answers
        slow_answers = []
        for sock in slow:
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            slow_answers.append(answer.status)
        assert slow_answers == [408] * len(slow), slow_answers
        for sock in idle + slow_headers: assert sock.recv(1) == b'', 'a connection without a request was not closed'
    finally:
        stop.set()
        trickler.join(SANITY_S)
        for sock in idle + slow + slow_headers: sock.close()
    assert _complete(guarded).status_code == 200
    _assert_flat(before, _rss_mb(guarded))

def test_stream_read_slowly(guarded):
    """A streaming client that stops reading: once the socket buffers between them are full (a few MB: the chunks
    here carry 20 logprobs each) and 16 tokens per choice wait on top, the server drops the stream (the backend
    request is aborted, its KV pages freed), while another request is served. When the client reads at last, it finds
    what was sent before, then an error event."""
    before, aborted = _rss_mb(guarded), guarded.state()['stats'].get('aborted', 0)
    sock = _connect(guarded, rcvbuf=4096)            # a small window: the server's writes back up sooner
    body = json.dumps({'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Once upon a time'}], 'n': 32,
                       'max_tokens': 480, 'ignore_eos': True, 'temperature': 0, 'logprobs': True, 'top_logprobs': 20,
                       'stream': True}).encode()
    sock.sendall(_head('/v1/chat/completions', {**_auth(), 'Content-Length': str(len(body))}) + body)
    deadline = time.monotonic() + 4 * SANITY_S
    while guarded.state()['stats'].get('aborted', 0) == aborted and time.monotonic() < deadline: time.sleep(0.2)
    assert _complete(guarded).status_code == 200
    state = guarded.state()
    assert state['open_requests'] == 0 and state['stats']['aborted'] > aborted, state
    answer = http.client.HTTPResponse(sock)          # now read it all
    answer.begin()
    events = [line[6:] for line in answer.read().decode().splitlines() if line.startswith('data: ')]
    sock.close()
    assert answer.status == 200 and events[-1] == '[DONE]', events[-3:]
    error = json.loads(events[-2])['error']
    assert error['code'] == 'stream_backlog_exceeded', error
    assert 32 < len(events) < 32 * 480, len(events)  # the first tokens arrived, far from all of them
    _assert_flat(before, _rss_mb(guarded))

# -- TLS ------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which('openssl') is None, reason='needs the openssl command to make a certificate')
def test_tls(model_dir, tmp_path):
    "With a key and a certificate, the server speaks HTTPS only; a client that trusts the certificate is served."
    key, cert = tmp_path / 'key.pem', tmp_path / 'cert.pem'
    subprocess.run(['openssl', 'req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', key, '-out', cert,
                    '-days', '1', '-subj', '/CN=127.0.0.1', '-addext', 'subjectAltName=IP:127.0.0.1'],
                   check=True, capture_output=True)
    with ServerProcess(model_dir, served_model_name='tiny', api_key=KEYS[0], ssl_keyfile=str(key),
                       ssl_certfile=str(cert), **ENGINE) as s:
        assert s.url.startswith('https://')
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trusted, timeout=SANITY_S) as client:
            assert client.get(s.url + '/health').status_code == 200
            r = client.post(s.url + '/v1/completions', headers=_auth(),
                            json={'model': 'tiny', 'prompt': 'Hi', 'max_tokens': 2})
            assert r.status_code == 200 and r.json()['usage']['completion_tokens'] == 2, r.text
        with pytest.raises(httpx.HTTPError): httpx.get(s.url.replace('https', 'http') + '/health', timeout=10)
        with pytest.raises(httpx.ConnectError): httpx.get(s.url + '/health', timeout=10)   # not trusted by default

#!/usr/bin/env python3
"""Abusive clients against a real `nanoserve serve` on a tiny model (context 512): the time each takes to be answered
and the resident memory of the server's three processes around it. The figures of issue #23's note come from here:

    python scripts/abuse.py [CASE ...]             # default: every case
    python scripts/abuse.py --serve '{"max_request_bytes": 8388608}' body20

Cases: body20 / body100 (a completion whose prompt makes a 20 / 100 MB body, sent with a Content-Length),
ctx10x (a prompt of 10x the context in characters), slow-body (20 clients sending a body a byte every 0.2 s beside
normal requests), idle (1000 connections that send nothing, beside normal requests), fd-limit (1100 idle connections
against a server started with a soft limit of 1024 open files), plp (not in the default set: a context of 4096, a
3,000-token prompt with prompt_logprobs 20 beside a stream: its seconds, the stream's median and worst gap).
A server whose processes grow past `--rss-cap-gb` together is killed (the case then reads 'killed'): the machine
is shared.
"""
import argparse, json, os, resource, selectors, socket, sys, tempfile, threading, time
import httpx
from nanoserve.testing import save_tiny_model
from nanoserve.testing import ServerProcess

ENGINE = dict(device='cpu', page_size=4, num_pages=256)

def rss_mb(pid: int) -> float:
    try:
        with open(f'/proc/{pid}/status') as f:
            return int(next(line for line in f if line.startswith('VmRSS:')).split()[1]) / 1024
    except (FileNotFoundError, StopIteration, ProcessLookupError): return 0.0

class Watch:
    "Samples the server processes' RSS every 20 ms; kills them all past the cap."
    def __init__(self, pids: dict, cap_mb: float):
        self.pids, self.cap_mb, self.killed = pids, cap_mb, False
        self.peak = {name: 0.0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> dict: return {name: rss_mb(pid) for name, pid in self.pids.items()}

    def _run(self):
        while not self._stop.is_set():
            rss = self.now()
            for name, mb in rss.items(): self.peak[name] = max(self.peak[name], mb)
            if sum(rss.values()) > self.cap_mb and not self.killed:
                self.killed = True
                for pid in self.pids.values():
                    try: os.kill(pid, 9)
                    except ProcessLookupError: pass
            time.sleep(0.02)

    def __enter__(self):
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

def post_raw(url: str, path: str, head: bytes, repeat: bytes, times: int, tail: bytes, timeout: float,
             headers: dict | None = None) -> tuple[str, float]:
    "POST `head + repeat * times + tail` with a Content-Length, in chunks: the status line (or why none), seconds."
    host, port = url.removeprefix('http://').split(':')
    length = len(head) + len(repeat) * times + len(tail)
    extra = ''.join(f'{k}: {v}\r\n' for k, v in (headers or {}).items())
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    start = time.monotonic()
    def send():
        try:
            sock.sendall(f'POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         f'Content-Length: {length}\r\n{extra}\r\n'.encode() + head)
            for _ in range(times): sock.sendall(repeat)
            sock.sendall(tail)
        except OSError: pass                   # the server answered (and closed) before the body was all sent
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        data = b''
        while b'\r\n\r\n' not in data:
            chunk = sock.recv(65536)
            if not chunk: return 'closed without an answer', time.monotonic() - start
            data += chunk
        return data.split(b'\r\n', 1)[0].decode(), time.monotonic() - start
    except socket.timeout: return f'no answer within {timeout:.0f} s', time.monotonic() - start
    except OSError as e: return f'{type(e).__name__}', time.monotonic() - start
    finally:
        sock.close()
        sender.join(5)

def big_body(url: str, mb: int, timeout: float, headers: dict | None = None):
    head, tail = b'{"model": "tiny", "max_tokens": 1, "prompt": "', b'"}'
    return post_raw(url, '/v1/completions', head, b'hello world ' * 87381, mb, tail, timeout, headers)   # ~1 MiB each

def normal_requests(url: str, count: int, headers: dict | None = None) -> tuple[int, float]:
    "`count` small completions one after another: how many answered 200, and the slowest one's seconds."
    ok, slowest = 0, 0.0
    for _ in range(count):
        start = time.monotonic()
        try:
            r = httpx.post(url + '/v1/completions', json={'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 8},
                           headers=headers, timeout=60)
            ok += r.status_code == 200
        except httpx.HTTPError: pass
        slowest = max(slowest, time.monotonic() - start)
    return ok, slowest

def closed_by_server(socks: list, wait: float) -> tuple[int, float]:
    "How many of `socks` the server closed (or answered) within `wait` seconds, and when the last of them went."
    sel, start, last, closed = selectors.DefaultSelector(), time.monotonic(), 0.0, 0
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    while closed < len(socks) and time.monotonic() - start < wait:
        for key, _ in sel.select(timeout=0.2):
            sel.unregister(key.fileobj)
            closed += 1
            last = time.monotonic() - start
    sel.close()
    return closed, last

def run_case(name: str, s: ServerProcess, watch: Watch, headers: dict) -> dict:
    url = s.url
    if name in ('body20', 'body100'):
        status, seconds = big_body(url, int(name[4:]), 120, headers)
        return {'answer': status, 'seconds': round(seconds, 2)}
    if name == 'ctx10x':
        start = time.monotonic()
        body = {'model': 'tiny', 'prompt': 'hello ' * 853 + 'hi', 'max_tokens': 1}     # 5120 characters
        r = httpx.post(url + '/v1/completions', json=body, headers=headers, timeout=120)
        return {'answer': f'{r.status_code} {r.json()["error"]["message"][:90] if r.status_code != 200 else ""}',
                'seconds': round(time.monotonic() - start, 3)}
    if name == 'slow-body':
        host, port = url.removeprefix('http://').split(':')
        socks = []
        for _ in range(20):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: 2000\r\n' + b''.join(f'{k}: {v}\r\n'.encode() for k, v in headers.items())
                         + b'\r\n{')
            socks.append(sock)
        stop = threading.Event()
        def trickle():
            while not stop.is_set():
                for sock in socks:
                    try: sock.send(b' ')
                    except OSError: pass
                time.sleep(0.2)
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        ok, slowest = normal_requests(url, 8, headers)
        closed, last = closed_by_server(socks, 45)
        stop.set()
        t.join()
        for sock in socks: sock.close()
        return {'normal ok': f'{ok}/8', 'slowest normal s': round(slowest, 2),
                'slow clients cut': f'{closed}/20', 'last cut at s': round(last, 1)}
    if name in ('idle', 'fd-limit'):
        host, port = url.removeprefix('http://').split(':')
        count = 1000 if name == 'idle' else 1100
        socks = [socket.create_connection((host, int(port))) for _ in range(count)]
        time.sleep(0.5)
        ok, slowest = normal_requests(url, 8, headers)
        closed, last = closed_by_server(socks, 45)
        for sock in socks: sock.close()
        return {'normal ok': f'{ok}/8', 'slowest normal s': round(slowest, 2),
                'idle closed by server': f'{closed}/{count}', 'last closed at s': round(last, 1)}
    if name == 'plp': return prompt_logprobs_beside_a_stream(url, headers)
    raise ValueError(name)

def prompt_logprobs_beside_a_stream(url: str, headers: dict, prompt_len: int = 3000) -> dict:
    "A prompt of `prompt_len` token ids with `prompt_logprobs: 20` sent beside a stream: its time, the stream's gaps."
    times, stop = [], threading.Event()
    def stream():
        body = {'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 4000, 'ignore_eos': True, 'stream': True}
        with httpx.stream('POST', url + '/v1/completions', json=body, headers=headers, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith('data:'): times.append(time.monotonic())
                if stop.is_set(): break
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    time.sleep(2)
    start = time.monotonic()
    prompt = [3 + i * 7 % 400 for i in range(prompt_len)]
    body = {'model': 'tiny', 'prompt': prompt, 'max_tokens': 1, 'prompt_logprobs': 20}
    r = httpx.post(url + '/v1/completions', json=body, headers=headers, timeout=900)
    end = time.monotonic()
    stop.set()
    t.join(timeout=30)
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if start <= b <= end + 0.5)
    return {'answer': r.status_code, 'seconds': round(end - start, 2), 'response MB': round(len(r.content) / 1e6, 1),
            'stream gap p50 ms': round(gaps[len(gaps) // 2] * 1e3, 1) if gaps else None,
            'stream worst gap s': round(gaps[-1], 3) if gaps else None}

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('cases', nargs='*', default=['body20', 'body100', 'ctx10x', 'slow-body', 'idle', 'fd-limit'])
    p.add_argument('--serve', default='{}', help="run_server's extra arguments, as JSON")
    p.add_argument('--rss-cap-gb', type=float, default=5.0)
    args = p.parse_args()
    serve = json.loads(args.serve)
    long_context = {'max_position_embeddings': 4096} if 'plp' in args.cases else {}
    model = save_tiny_model(tempfile.mkdtemp() + '/tiny', 'llama', tokenizer=True, **long_context)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for name in args.cases:
        if name == 'fd-limit': resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))   # the server inherits it
        log = open(tempfile.mkstemp(suffix='.log')[1], 'w')
        engine = {**ENGINE, 'num_pages': 1100} if name == 'plp' else ENGINE     # plp: 4,400 KV slots
        s = ServerProcess(str(model), served_model_name='tiny', stderr=log, **engine, **serve).start()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        headers = s.headers
        pids = {'api': s.proc.pid, **s.state()['pids']}
        time.sleep(1)
        with Watch(pids, args.rss_cap_gb * 1024) as watch:
            before = watch.now()
            result = run_case(name, s, watch, headers)
            time.sleep(3)
            after = watch.now()
        alive = s.proc.poll() is None and not watch.killed
        try: health = httpx.get(s.url + '/health', timeout=5).status_code if alive else 'down'
        except httpx.HTTPError as e: health = type(e).__name__
        result.update({'rss before MB': {k: round(v) for k, v in before.items()},
                       'rss peak MB': {k: round(v) for k, v in watch.peak.items()},
                       'rss after MB': {k: round(v) for k, v in after.items()},
                       'health after': health, 'killed at cap': watch.killed})
        print(json.dumps({name: result}), flush=True)
        if s.proc.poll() is None: s.stop(timeout=30)

if __name__ == '__main__': main()

"""The kind of reward server users write in twenty lines: slime format on the standard library's
ThreadingHTTPServer (HTTP/1.0, one connection per request, a listen backlog of 5), scoring the CPU demo's
task. Used by `bench/reward_throughput.py`, the demo measurement in docs/benchmarks.md and
tests/test_reward_outage.py.

    python bench/stdlib_reward_server.py [PORT] [--backlog N]   # prints the port it listens on

`StdlibServer` runs it in a subprocess for the benchmarks.

A response of exactly `poison` gets HTTP 500 (a sample that crashes the server's reward function).
"""

import argparse
import json
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reward(response: str, label: str) -> float:
    """The demo's arithmetic reward (`vime.demo.arithmetic.arithmetic_reward`): exactly the label, once
    whitespace and trailing end-of-sequence markers are stripped."""
    text = response.strip()
    while text.endswith("<eos>"):
        text = text[: -len("<eos>")].rstrip()
    return 1.0 if label and text == str(label).strip() else 0.0


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["response"] == "poison":
            status, out = 500, b'{"error": "reward function raised"}'
        else:
            status, out = 200, json.dumps(reward(body["response"], body["label"])).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


class StdlibServer:
    """This server in a subprocess, on `port` (0: a free one); `url` is its slime arithmetic endpoint."""

    def __init__(self, port: int = 0, backlog: int | None = None) -> None:
        argv = [sys.executable, __file__, str(port)]
        if backlog is not None:
            argv += ["--backlog", str(backlog)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/slime/arithmetic"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int, nargs="?", default=0)
    p.add_argument("--backlog", type=int, default=None, help="listen backlog (the standard library's is 5)")
    args = p.parse_args()
    if args.backlog is not None:
        ThreadingHTTPServer.request_queue_size = args.backlog
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

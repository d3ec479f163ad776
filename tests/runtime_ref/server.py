#!/usr/bin/env python3
"""A reference "echo" runtime for the Switchboard runtime protocol, version 1.

Written from docs/runtime-protocol.md (and its OpenAPI summary) alone, to show
that the document is enough to implement the protocol. Python standard library
only.

The runtime answers every run with "echo: " followed by the texts of the
inputs the run answers, joined with "\\n". It "types" that answer word by word
(--word-delay-ms between words), streaming `run.delta` events; the moment
after each typed word is a step boundary, where interrupts take effect and
injected inputs are taken in.

Usage:
    python3 server.py --port 0 --state-file PATH [--token T] [--word-delay-ms N]

Once listening it prints `LISTENING <port>` on stdout. Logs go to stderr.

Persistence: all runs, idempotency keys, conversation queues and durable
events live in one JSON file, rewritten atomically (temp file + os.replace)
after every change and before any answer or durable event leaves the process.

Restart policy (a choice the protocol leaves to the runtime): a run that was
`running` when the process died is run again from the start (its `epoch`
goes up by one); a run whose interrupt had been requested ends the way that
was requested, with the partial answer recorded at the time of the request;
queued runs stay queued in their order.
"""

import argparse
import hmac
import json
import os
import queue
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

POLICIES = ("queue", "inject", "interrupt", "interrupt-next", "supersede")
TERMINAL = ("completed", "interrupted", "superseded", "absorbed", "cancelled", "failed")
HEARTBEAT_SECS = 2.0
RETENTION_MS = 8 * 24 * 3600 * 1000  # the protocol asks for at least 7 days
MAX_BODY = 16 * 1024 * 1024
MAX_BATCH = 512
WORD = re.compile(r"\s*\S+")


def now_ms():
    return int(time.time() * 1000)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class ApiError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status."""

    RETRYABLE = {"unauthorized", "busy", "unavailable", "internal", "queue_full"}

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self):
        return error_body(self.code, self.message)


def error_body(code, message):
    return {"error": {"code": code, "message": message,
                      "retryable": code in ApiError.RETRYABLE}}


def bad_request(message):
    return ApiError(400, "bad_request", message)


# ---------------------------------------------------------------- validation

def validate_submission(i, sub):
    """Raises bad_request naming the field when submission `i` is malformed."""
    where = "submissions[%d]" % i

    def need(cond, field, what):
        if not cond:
            raise bad_request("%s%s must be %s" % (where, field and "." + field, what))

    need(isinstance(sub, dict), "", "an object")
    key = sub.get("idempotency_key")
    need(isinstance(key, str) and 1 <= len(key) <= 200, "idempotency_key",
         "a string of 1 to 200 characters")
    cid = sub.get("conversation_id")
    need(isinstance(cid, str) and cid != "", "conversation_id", "a non-empty string")
    inp = sub.get("input")
    need(isinstance(inp, dict), "input", "an object")
    need(isinstance(inp.get("text"), str), "input.text", "a string")
    atts = inp.get("attachments")
    if atts is not None:
        need(isinstance(atts, list) and all(
            isinstance(a, dict) and isinstance(a.get("reference"), str) for a in atts),
            "input.attachments", "an array of objects with a string `reference`")
    need(isinstance(sub.get("context"), dict), "context", "an object")
    need(sub.get("input_policy") in POLICIES, "input_policy", "one of " + ", ".join(POLICIES))
    need(isinstance(sub.get("coalesce_pending"), bool), "coalesce_pending", "a boolean")
    mq = sub.get("max_queued_inputs")
    need(mq is None or (isinstance(mq, int) and not isinstance(mq, bool) and mq >= 1),
         "max_queued_inputs", "an integer >= 1")
    soft = sub.get("soft_interrupt")
    need(soft is None or isinstance(soft, bool), "soft_interrupt", "a boolean")


# ---------------------------------------------------------------- state file

class StateFile:
    """The JSON state file, always replaced atomically."""

    def __init__(self, path):
        self.path = path

    def load(self):
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def save(self, state):
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class Subscriber:
    """One open event stream: a queue of events to write out."""

    LIMIT = 10000  # a client this far behind has its stream ended (MAY)

    def __init__(self):
        self.queue = queue.Queue()
        self.closed = False

    def push(self, event):
        if self.closed:
            return
        if self.queue.qsize() >= self.LIMIT:
            self.closed = True
            self.queue.put(None)
        else:
            self.queue.put(event)


# ---------------------------------------------------------------- the runtime

class Runtime:
    """Runs, conversations and events, all guarded by one condition variable.

    A run is a plain dict (so it persists as is). A conversation is
    {"running": run_id or None, "queue": [run_id, ...]}: at most one run
    runs per conversation, queued runs start in list order. One worker thread
    per busy conversation executes its runs.
    """

    def __init__(self, state_file, word_delay):
        self.file = state_file
        self.word_delay = word_delay
        self.cond = threading.Condition()
        self.runs, self.keys, self.convs, self.events = {}, {}, {}, []
        self.next_run_id = self.next_event_id = 1
        self.workers = set()      # conversations with a live worker thread
        self.subscribers = set()
        self.pending = []         # events to publish once the state is saved
        self.dirty = False
        self.ready = False
        self.stopping = False

    # -- persistence and publication

    def _snapshot(self):
        return {"version": 1, "next_run_id": self.next_run_id,
                "next_event_id": self.next_event_id, "runs": self.runs,
                "keys": self.keys, "conversations": self.convs, "events": self.events}

    def _commit(self):
        """Save the state if it changed, then publish what is pending."""
        if self.dirty:
            self.file.save(self._snapshot())
            self.dirty = False
        for event in self.pending:
            for sub in list(self.subscribers):
                sub.push(event)
        self.pending = []

    def _emit(self, event, durable=False):
        if durable:
            event["event_id"] = self.next_event_id
            self.next_event_id += 1
            self.events.append(event)
            self.dirty = True
        self.pending.append(event)
        return event

    def _emit_state(self, run):
        self._emit({"type": "run.state", "run_id": run["run_id"],
                    "conversation_id": run["conversation_id"], "state": run["state"]})

    def recover(self):
        """Load the state file and finish what the last process left running."""
        with self.cond:
            state = self.file.load()
            if state:
                self.next_run_id = state["next_run_id"]
                self.next_event_id = state["next_event_id"]
                self.runs, self.keys = state["runs"], state["keys"]
                self.convs, self.events = state["conversations"], state["events"]
                self._prune()
            for cid, conv in self.convs.items():
                rid = conv["running"]
                if rid is not None:
                    run = self.runs[rid]
                    if run["state"] == "interrupt_requested":
                        run["typed"] = run["interrupt"]["partial"]
                        self._finish_interrupted(run)
                    else:  # died while running: run it again from the start
                        conv["running"] = None
                        run["state"] = "queued"
                        conv["queue"].insert(0, rid)
                        self.dirty = True
                self._ensure_progress(cid)
            self.dirty = True
            self._commit()
            self.ready = True

    def _prune(self):
        """Forget events and finished runs older than the retention period."""
        cutoff = now_ms() - RETENTION_MS
        self.events = [e for e in self.events if e["at"] >= cutoff]
        old = {rid for rid, r in self.runs.items()
               if r["state"] in TERMINAL and r.get("finished_at", cutoff) < cutoff}
        self.runs = {rid: r for rid, r in self.runs.items() if rid not in old}
        self.keys = {k: rid for k, rid in self.keys.items() if rid not in old}

    # -- scheduling

    def _conv(self, cid):
        return self.convs.setdefault(cid, {"running": None, "queue": []})

    def _new_run(self, cid, key, text, state):
        rid = str(self.next_run_id)
        self.next_run_id += 1
        run = {"run_id": rid, "conversation_id": cid, "state": state, "inputs": [text],
               "keys": [key], "priority": False, "epoch": 0, "typed": "",
               "interrupt": None, "reason": None, "answer": None, "attachments": None,
               "event_id": None, "answered_by": None, "created_at": now_ms()}
        self.runs[rid] = run
        self.keys[key] = rid
        self.dirty = True
        self._emit({"type": "run.admitted", "run_id": rid, "conversation_id": cid,
                    "state": state, "at": now_ms()}, durable=True)
        return run

    def _enqueue(self, conv, run, priority):
        """Ordinary runs go to the tail; "next" runs go after earlier "next" runs."""
        if run["run_id"] in conv["queue"]:
            conv["queue"].remove(run["run_id"])
        run["priority"] = run["priority"] or priority
        if run["priority"]:
            pos = 0
            while pos < len(conv["queue"]) and self.runs[conv["queue"][pos]]["priority"]:
                pos += 1
            conv["queue"].insert(pos, run["run_id"])
        else:
            conv["queue"].append(run["run_id"])
        self.dirty = True

    def _ensure_progress(self, cid):
        """Start the next queued run if none runs, and make sure a worker runs it."""
        conv = self.convs[cid]
        if conv["running"] is None and conv["queue"]:
            run = self.runs[conv["queue"].pop(0)]
            conv["running"] = run["run_id"]
            run["state"], run["typed"] = "running", ""
            run["epoch"] += 1
            self.dirty = True
            self._emit_state(run)
        if conv["running"] is not None and cid not in self.workers:
            self.workers.add(cid)
            threading.Thread(target=self._worker, args=(cid,), daemon=True).start()

    def _request_interrupt(self, run, mode, reason):
        run["state"] = "interrupt_requested"
        run["interrupt"] = {"mode": mode, "reason": reason, "partial": run["typed"]}
        self.dirty = True
        self._emit_state(run)
        self.cond.notify_all()

    def _finish(self, run, state, answer=None, reason=None):
        run.update(state=state, answer=answer, reason=reason, finished_at=now_ms(),
                   attachments=[] if answer is not None else None)
        event = self._emit({
            "type": "run.finished", "run_id": run["run_id"],
            "conversation_id": run["conversation_id"], "state": state, "reason": reason,
            "answer": answer, "attachments": [], "answered_by": run["answered_by"],
            "at": run["finished_at"]}, durable=True)
        run["event_id"] = event["event_id"]
        conv = self.convs[run["conversation_id"]]
        if conv["running"] == run["run_id"]:
            conv["running"] = None
        self._ensure_progress(run["conversation_id"])

    def _finish_interrupted(self, run):
        req = run["interrupt"]
        if req["mode"] == "supersede":
            self._finish(run, "superseded", None, req["reason"])
        else:
            self._finish(run, "interrupted", run["typed"], req["reason"])

    # -- executing runs

    def _worker(self, cid):
        with self.cond:
            while True:
                rid = self.convs[cid]["running"]
                if rid is None:
                    self.workers.discard(cid)
                    return
                self._execute(self.runs[rid])

    def _execute(self, run):
        """Type the answer word by word; called and returns with the lock held."""
        seq = 0
        while True:
            # A step boundary: interrupts take effect, injected inputs join.
            if run["interrupt"]:
                self._finish_interrupted(run)
                break
            target = "echo: " + "\n".join(run["inputs"])
            if len(run["typed"]) >= len(target):
                self._finish(run, "completed", target)
                break
            word = WORD.match(target, len(run["typed"]))
            run["typed"] = target[:word.end() if word else len(target)]
            seq += 1
            self._emit({"type": "run.delta", "run_id": run["run_id"],
                        "conversation_id": run["conversation_id"],
                        "epoch": run["epoch"], "seq": seq, "text": run["typed"]})
            self._commit()
            deadline = time.monotonic() + self.word_delay
            while not run["interrupt"] and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
        self._commit()

    # -- the protocol operations

    def submit(self, submissions):
        for i, sub in enumerate(submissions):
            validate_submission(i, sub)
        with self.cond:
            if self.stopping or not self.ready:
                raise ApiError(503, "unavailable", "the runtime is starting or stopping")
            admissions = [self._admit(sub) for sub in submissions]
            self._commit()
            return admissions

    def _admit(self, sub):
        key, cid = sub["idempotency_key"], sub["conversation_id"]
        if key in self.keys:
            return self._admission(self.runs[self.keys[key]], new=False)
        conv = self._conv(cid)
        policy, text = sub["input_policy"], sub["input"]["text"]
        running = self.runs[conv["running"]] if conv["running"] else None
        active = running if running and running["state"] == "running" else None

        if policy == "inject" and active:
            # The running run takes the input in at its next step boundary.
            active["inputs"].append(text)
            run = self._new_run(cid, key, text, "absorbed")
            run["answered_by"] = active["run_id"]
            self._finish(run, "absorbed")
            return self._admission(run, new=True)

        # Every other case: the input waits for its turn in the queue.
        limit = sub.get("max_queued_inputs")
        waiting = sum(len(self.runs[r]["inputs"]) for r in conv["queue"])
        if limit is not None and waiting >= limit:
            return error_body("queue_full", "%d inputs are waiting" % waiting)
        next_ = policy in ("interrupt-next", "supersede")
        if active and policy in ("interrupt", "interrupt-next", "supersede"):
            mode = "supersede" if policy == "supersede" else "interrupt"
            self._request_interrupt(active, mode, "new_input")
        if sub["coalesce_pending"] and conv["queue"]:
            run = self.runs[conv["queue"][-1]]
            run["inputs"].append(text)
            run["keys"].append(key)
            self.keys[key] = run["run_id"]
        else:
            run = self._new_run(cid, key, text, "queued")
        self._enqueue(conv, run, next_)
        self._ensure_progress(cid)
        return self._admission(run, new=True)

    @staticmethod
    def _admission(run, new):
        adm = {"run_id": run["run_id"], "new": new, "state": run["state"]}
        if run["answered_by"] is not None:
            adm["answered_by"] = run["answered_by"]
        return adm

    def get_run(self, rid):
        with self.cond:
            run = self.runs.get(rid)
            if run is None:
                raise ApiError(404, "not_found", "no run %s" % rid)
            out = {k: run[k] for k in ("run_id", "conversation_id", "state", "answered_by")}
            if run["state"] in TERMINAL:
                out.update(reason=run["reason"], answer=run["answer"],
                           attachments=run["attachments"] or [], event_id=run["event_id"])
            return out

    def interrupt(self, rid, mode, reason):
        with self.cond:
            run = self.runs.get(rid)
            if run is None:
                raise ApiError(404, "not_found", "no run %s" % rid)
            if run["state"] in TERMINAL:
                raise ApiError(409, "conflict", "run %s is already %s" % (rid, run["state"]))
            if run["state"] == "queued":
                self.convs[run["conversation_id"]]["queue"].remove(rid)
                self._finish(run, "cancelled", None, reason)
            elif run["state"] == "running":
                self._request_interrupt(run, mode, reason)
            # already interrupt_requested: the first request stands
            self._commit()
            return {"run_id": rid, "state": run["state"]}

    def stop(self, cid, reason):
        with self.cond:
            conv = self.convs.get(cid)
            if conv is None:
                return {"interrupted": None, "cancelled": 0}
            queued, conv["queue"] = conv["queue"], []
            for rid in queued:
                self._finish(self.runs[rid], "cancelled", None, reason)
            interrupted = conv["running"]
            if interrupted and self.runs[interrupted]["state"] == "running":
                self._request_interrupt(self.runs[interrupted], "interrupt", reason)
            self.dirty = True
            self._commit()
            return {"interrupted": interrupted, "cancelled": len(queued)}

    def subscribe(self, after):
        """Register a stream; returns it with the stored events it must replay."""
        with self.cond:
            sub = Subscriber()
            self.subscribers.add(sub)
            return sub, [e for e in self.events if e["event_id"] > after]

    def unsubscribe(self, sub):
        with self.cond:
            self.subscribers.discard(sub)


# ---------------------------------------------------------------- HTTP

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    runtime = None  # set by main()
    token = None

    def log_message(self, fmt, *args):
        log("%s %s" % (self.address_string(), fmt % args))

    # -- plumbing

    def _send_json(self, status, obj, headers=()):
        data = json.dumps(obj).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self):
        """Reads the whole body (so keep-alive stays in sync); None if empty."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or (length and not length.isdigit()):
            self.close_connection = True
            raise bad_request("a request body needs a Content-Length")
        length = int(length or 0)
        if length > MAX_BODY:
            self.close_connection = True
            raise bad_request("the body is larger than %d bytes" % MAX_BODY)
        return self.rfile.read(length) if length else None

    def _json_body(self, raw, required):
        if raw is None:
            if required:
                raise bad_request("a JSON body is required")
            return {}
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise bad_request("the body is not valid JSON")
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    def _authorized(self):
        if not self.token:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), ("Bearer " + self.token).encode())

    def _handle(self, method):
        try:
            raw = self._read_body()
            if not self._authorized():
                raise ApiError(401, "unauthorized", "missing or wrong bearer token")
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            self._route(method, parts, url.query, raw)
        except ApiError as e:
            headers = [("WWW-Authenticate", "Bearer")] if e.status == 401 else []
            self._send_json(e.status, e.body(), headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # pragma: no cover - the catch-all of the table
            log("internal error: %r" % e)
            self._send_json(500, error_body("internal", "internal error"))

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    # -- endpoints

    def _route(self, method, parts, query, raw):
        rt = self.runtime
        if parts[:1] != ["v1"]:
            raise ApiError(404, "not_found", "no such endpoint")
        # ("POST", "runs", "*", "interrupt") for POST /v1/runs/42/interrupt
        route = (method,) + tuple(p if i % 2 == 0 else "*" for i, p in enumerate(parts[1:]))
        if route == ("GET", "health"):
            if rt.ready and not rt.stopping:
                return self._send_json(200, {"status": "ok"})
            raise ApiError(503, "unavailable", "starting or stopping")
        if route == ("GET", "events"):
            return self._events(query)
        if route == ("GET", "runs", "*"):
            return self._send_json(200, rt.get_run(parts[2]))
        if route == ("POST", "submissions"):
            subs = self._json_body(raw, True).get("submissions")
            if not isinstance(subs, list) or not 1 <= len(subs) <= MAX_BATCH:
                raise bad_request("submissions must be an array of 1 to %d items" % MAX_BATCH)
            return self._send_json(200, {"admissions": rt.submit(subs)})
        if route == ("POST", "runs", "*", "interrupt"):
            body = self._json_body(raw, True)
            mode, reason = body.get("mode"), body.get("reason")
            if mode not in ("interrupt", "supersede"):
                raise bad_request("mode must be interrupt or supersede")
            if reason is not None and not isinstance(reason, str):
                raise bad_request("reason must be a string")
            return self._send_json(202, rt.interrupt(parts[2], mode, reason))
        if route == ("POST", "conversations", "*", "stop"):
            reason = self._json_body(raw, False).get("reason")
            if reason is not None and not isinstance(reason, str):
                raise bad_request("reason must be a string")
            return self._send_json(200, rt.stop(parts[2], reason))
        raise ApiError(404, "not_found", "no such endpoint")

    def _events(self, query):
        values = parse_qs(query).get("after", ["0"])
        if not values[-1].isdigit():
            raise bad_request("after must be a non-negative integer")
        sub, backlog = self.runtime.subscribe(int(values[-1]))
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for event in backlog:
                self._chunk(event)
            last_beat = time.monotonic()
            while not self.runtime.stopping:
                # A heartbeat every HEARTBEAT_SECS, however busy the stream is.
                if time.monotonic() - last_beat >= HEARTBEAT_SECS:
                    self._chunk({"type": "heartbeat", "at": now_ms()})
                    last_beat = time.monotonic()
                try:
                    wait = last_beat + HEARTBEAT_SECS - time.monotonic()
                    event = sub.queue.get(timeout=max(wait, 0.01))
                except queue.Empty:
                    continue
                if event is None:  # the subscriber fell too far behind
                    break
                self._chunk(event)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            self.runtime.unsubscribe(sub)
            self.close_connection = True

    def _chunk(self, event):
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode("utf-8")
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description="Echo runtime speaking the Switchboard runtime protocol v1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--state-file", required=True)
    ap.add_argument("--token", default=None)
    ap.add_argument("--word-delay-ms", type=int, default=0)
    args = ap.parse_args()

    runtime = Runtime(StateFile(args.state_file), args.word_delay_ms / 1000.0)
    runtime.recover()
    Handler.runtime, Handler.token = runtime, args.token
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True

    def on_signal(signum, frame):
        runtime.stopping = True  # health answers 503, streams end
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("LISTENING %d" % server.server_address[1], flush=True)
    log("echo runtime listening on 127.0.0.1:%d, state in %s"
        % (server.server_address[1], args.state_file))
    server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()

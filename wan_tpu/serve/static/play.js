// The live Matrix-Game-2 page (wan_tpu/serve/play.py has the protocol): frames from the WebSocket onto the
// canvas as they arrive (the server paces them), the keys held and the pointer's motion back as actions.
"use strict";
(() => {
  const params = new URLSearchParams(location.search);
  const apiKey = params.get("api_key");
  const withKey = (path) => (apiKey ? `${path}${path.includes("?") ? "&" : "?"}api_key=${encodeURIComponent(apiKey)}` : path);
  const $ = (id) => document.getElementById(id);
  const canvas = $("screen");
  const context = canvas.getContext("2d");
  const POINTER_TICK_MS = 50;
  const POINTER_FULL_PX = 20; // pointer travel per tick that turns the camera by a whole step

  const state = {
    hello: null, bindings: new Map(), stream: 0, seq: 0, sentAt: new Map(), held: new Set(), pointer: [0, 0],
    moved: [0, 0], step: 0, lastAction: "", paused: false, recording: false, image: null, started: null,
    shown: [], frames: 0, drawing: Promise.resolve(),
  };

  function status(text, kind) {
    $("status").textContent = text;
    $("status").className = kind || "";
  }

  const url = new URL(withKey("play/ws"), location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const socket = new WebSocket(url);
  socket.binaryType = "arraybuffer";
  const send = (message) => socket.readyState === WebSocket.OPEN && socket.send(JSON.stringify(message));
  socket.onmessage = (event) => (typeof event.data === "string" ? onText(JSON.parse(event.data)) : onBinary(event.data));
  socket.onclose = () => status("disconnected: reload the page to play again", "error");
  // A page left for another may be kept, frozen, in the back/forward cache, its socket open: its stream
  // would hold a place, playing to no one, until the cache drops the page. Closed as the page is hidden,
  // the place goes to the next in line at once; a page brought back from the cache starts afresh.
  window.addEventListener("pagehide", () => socket.close());
  window.addEventListener("pageshow", (event) => event.persisted && location.reload());

  function onText(message) {
    switch (message.type) {
      case "hello": setup(message); break;
      case "waiting": status(message.message, "waiting"); break;
      case "started":
        state.stream = message.stream;
        state.frames = 0;
        state.sentAt.clear(); // actions sent before the stream began have no first frame to wait for
        status(`playing: seed ${message.seed}, ${message.fps} fps${message.smooth ? ", smooth" : ""}`);
        break;
      case "state":
        state.paused = message.paused;
        state.recording = message.recording;
        $("pause").textContent = state.paused ? "Resume" : "Pause";
        $("record").textContent = state.recording ? "Stop & download" : "Record";
        $("record").classList.toggle("on", state.recording);
        if (state.stream) status(state.paused ? "paused" : "playing");
        break;
      case "end": status(message.message); break;
      case "error": status(message.message, "error"); break;
    }
  }

  function onBinary(buffer) {
    const length = new DataView(buffer).getUint32(0);
    const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, length)));
    const type = header.kind === "video" ? "video/mp4" : `image/${header.format}`;
    const payload = new Blob([new Uint8Array(buffer, 4 + length)], { type });
    if (header.kind === "video") {
      download(payload, header.name);
      return;
    }
    if (header.stream !== state.stream) return;
    // Decoded one after the other, so frames reach the canvas in their order.
    state.drawing = state.drawing
      .then(() => createImageBitmap(payload))
      .then((bitmap) => {
        if (header.stream !== state.stream) return;
        if (canvas.width !== bitmap.width || canvas.height !== bitmap.height) {
          canvas.width = bitmap.width;
          canvas.height = bitmap.height;
        }
        context.drawImage(bitmap, 0, 0);
        bitmap.close();
        shown(header);
      })
      .catch((error) => status(`a frame could not be shown: ${error}`, "error"));
  }

  function shown(header) {
    const now = performance.now();
    state.frames += 1;
    state.shown.push(now);
    while (state.shown[0] < now - 1000) state.shown.shift();
    $("frames").textContent = String(header.index + 1);
    $("fps").textContent = state.shown.length > 1 ? String(state.shown.length) : "–";
    for (const [seq, at] of state.sentAt) {
      if (seq <= header.action) {
        $("latency").textContent = `${Math.round(now - at)} ms`;
        state.sentAt.delete(seq);
      }
    }
  }

  function download(blob, name) {
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = name;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 60000);
  }

  // ---- set-up from the server's hello ----

  function setup(hello) {
    state.hello = hello;
    $("variant").textContent = `${hello.variant} · ${hello.size[1]}×${hello.size[0]}`;
    canvas.width = hello.size[1];
    canvas.height = hello.size[0];
    const list = $("keys");
    list.textContent = "";
    for (const binding of hello.bindings) {
      state.bindings.set(binding.code, binding);
      state.step = Math.max(state.step, ...binding.mouse.map(Math.abs));
      const item = document.createElement("li");
      item.dataset.code = binding.code;
      const key = document.createElement("kbd");
      key.textContent = binding.label;
      item.append(key, ` ${binding.does}`);
      list.appendChild(item);
    }
    const wanted = Number(params.get("fps")) || hello.fps;
    const paces = [...new Set([hello.fps, 12, 16, 20, 24, 25, 30, wanted])]
      .filter((f) => f >= hello.fps_range[0] && f <= hello.fps_range[1]).sort((a, b) => a - b);
    $("pace").textContent = "";
    for (const fps of paces) $("pace").add(new Option(`${fps} fps`, String(fps), false, fps === wanted));
    $("seed").value = params.get("seed") || "0";
    $("smooth").checked = params.get("smooth") === "1";
    state.lastAction = JSON.stringify([[], hello.mouse ? [0, 0] : null]); // the idle action the server starts from
    loadExamples(params.get("example") || hello.examples[0]);
  }

  async function loadExamples(chosen) {
    const response = await fetch(withKey("play/examples"));
    const examples = await response.json();
    const box = $("examples");
    box.textContent = "";
    for (const example of examples) {
      const image = document.createElement("img");
      image.src = withKey(example.url);
      image.alt = image.title = example.name;
      image.onclick = () => start(example.name);
      image.dataset.name = example.name;
      box.appendChild(image);
    }
    start(chosen);
  }

  function settings() {
    return {
      seed: Number($("seed").value) || 0, fps: Number($("pace").value), format: params.get("format") || "jpeg",
      smooth: $("smooth").checked,
    };
  }

  function start(image) {
    state.image = image;
    state.started = settings();
    for (const img of $("examples").children) img.classList.toggle("chosen", img.dataset.name === image);
    send({ type: "start", image, ...state.started });
    status("starting…");
    canvas.focus();
  }

  // ---- controls ----

  $("pause").onclick = () => send({ type: state.paused ? "resume" : "pause" });
  $("record").onclick = () => send({ type: "record", on: !state.recording });
  $("reset").onclick = () => {
    if (state.image === null) return;
    const now = settings();
    const same = state.started && Object.keys(now).every((k) => now[k] === state.started[k]);
    if (same) send({ type: "reset" });
    else start(state.image);
  };
  $("upload").onchange = () => {
    const file = $("upload").files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => start(reader.result);
    reader.onerror = () => status(`${file.name} cannot be read`, "error");
    reader.readAsDataURL(file);
  };

  // ---- actions: keys held and pointer motion ----

  function sendAction() {
    if (!state.hello) return;
    const words = [...new Set([...state.held].map((code) => state.bindings.get(code).word))].sort();
    const mouse = state.hello.mouse ? state.pointer.map((v) => Math.round(v * 1000) / 1000) : null;
    const text = JSON.stringify([words, mouse]);
    if (text === state.lastAction) return;
    state.lastAction = text;
    state.seq += 1;
    state.sentAt.set(state.seq, performance.now());
    const message = { type: "action", keys: words, seq: state.seq };
    if (mouse) message.mouse = mouse;
    send(message);
    for (const item of $("keys").children) item.classList.toggle("held", state.held.has(item.dataset.code));
  }

  const typing = (event) => ["INPUT", "SELECT", "TEXTAREA"].includes(event.target.tagName);
  window.addEventListener("keydown", (event) => {
    if (typing(event) || !state.bindings.has(event.code)) return;
    event.preventDefault();
    if (!state.held.has(event.code)) {
      state.held.add(event.code);
      sendAction();
    }
  });
  window.addEventListener("keyup", (event) => {
    if (state.held.delete(event.code)) sendAction();
  });
  window.addEventListener("blur", () => {
    state.held.clear();
    sendAction();
  });

  canvas.addEventListener("click", () => {
    canvas.focus();
    if (state.hello && state.hello.mouse && canvas.requestPointerLock) canvas.requestPointerLock();
  });
  document.addEventListener("mousemove", (event) => {
    if (document.pointerLockElement !== canvas) return;
    state.moved[0] -= event.movementY; // up is +
    state.moved[1] += event.movementX;
  });
  setInterval(() => {
    if (!state.step) return;
    const clamp = (v) => Math.max(-state.step, Math.min(state.step, (v / POINTER_FULL_PX) * state.step));
    state.pointer = state.moved.map(clamp);
    state.moved = [0, 0];
    sendAction();
  }, POINTER_TICK_MS);
})();

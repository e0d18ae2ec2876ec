// voicertc demo page: one WebRTC call to the server, text in, speech out, live stats; with the
// Microphone toggle the call is two-way (the server hears the caller: speech state, transcripts,
// barge-in). A voice picker (GET /v1/voices), an instruction box, and a form that registers a new voice
// from an uploaded or recorded clip plus its transcript (POST /v1/voices). No framework. window.voicertc exposes the state and a 16 kHz capture for automated tests.
"use strict";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const token = query.get("token");
// ?ice_transport_policy=relay (or the Relay only box) gathers only TURN relay candidates (testing TURN)
const RELAY_QUERY = query.get("ice_transport_policy") === "relay";
const authHeaders = token ? { Authorization: `Bearer ${token}` } : {};
const PING_MS = 2000;
const DISCONNECTED_GRACE_MS = 5000; // a "disconnected" call that does not recover within this is hung up
const HEARD_RMS = 0.01; // level above which the page counts audio as heard
const MIC_CONSTRAINTS = { echoCancellation: true, noiseSuppression: true, autoGainControl: true };

const state = {
  pc: null,
  channel: null,
  location: null,
  audioCtx: null,
  analyser: null,
  speakAt: null, // performance.now() of the last Speak, until its audio is heard
  lastTtfaMs: null,
  capture: null, // Float32Array chunks at 16 kHz while capturing
  events: [],
  timers: [],
  disconnectTimer: null,
  mic: null, // the microphone MediaStream while a two-way call runs
  micCtx: null,
  levels: null, // {mic: [[t_ms, rms]], heard: [[t_ms, rms]]} per ~16 ms block while recording (tests)
  eventTimes: [], // performance.now() when each event in `events` arrived
  clip: null, // the clip (File or recorded Blob) a new voice is registered from
  recorder: null, // MediaRecorder while recording a clip
  iceServers: null, // what GET /v1/ice-servers handed out for the current call
  iceErrors: [], // icecandidateerror events of the current call: {url, errorCode, errorText}
};

function log(line) {
  const el = $("log");
  el.textContent = `${new Date().toISOString().slice(11, 23)} ${line}\n` + el.textContent.slice(0, 4000);
}

function setConnection(text) {
  $("state").textContent = text;
  $("s-connection").textContent = text;
}

function setButtons(inCall) {
  $("call").disabled = inCall;
  $("hangup").disabled = !inCall;
  setCanSpeak(false); // enabled when the data channel opens
}

// Speak and Interrupt travel on the data channel: usable only while it is open and connected.
function setCanSpeak(on) {
  $("speak").disabled = !on;
  $("interrupt").disabled = !on;
}

function channelOpen() {
  return !!state.channel && state.channel.readyState === "open";
}

function onConnectionState(pc) {
  const s = pc.connectionState;
  setConnection(s === "disconnected" ? "disconnected (waiting to recover)" : s);
  clearTimeout(state.disconnectTimer);
  state.disconnectTimer = null;
  if (s === "failed" || s === "closed") {
    log(`connection ${s}`);
    hangup();
  } else if (s === "disconnected") {
    setCanSpeak(false);
    state.disconnectTimer = setTimeout(() => {
      log("connection lost");
      hangup();
    }, DISCONNECTED_GRACE_MS);
  } else if (s === "connected") {
    setCanSpeak(channelOpen());
  }
}

function waitForIceGathering(pc, timeoutMs) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState === "complete") resolve();
    };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, timeoutMs); // send what we have: the server answers with all of its candidates
  });
}

async function call() {
  setButtons(true);
  setConnection("connecting");
  try {
    await startCall();
  } catch (err) {
    log(`call failed: ${err && err.message ? err.message : err}`);
    await hangup(); // restores the buttons
  }
}

// The STUN/TURN servers (with fresh TURN credentials) the server hands out ({ice_servers: []} when it
// has none), and the transport policy: "relay" when the page asks for it (the server echoes it).
async function fetchIceServers(relay) {
  const url = relay ? "/v1/ice-servers?ice_transport_policy=relay" : "/v1/ice-servers";
  const resp = await fetch(url, { headers: authHeaders }).catch(() => null);
  if (!resp || resp.status !== 200) return { ice_servers: [] };
  return resp.json();
}

function relayOnly() {
  return RELAY_QUERY || $("relay").checked;
}

async function startCall() {
  const handOut = await fetchIceServers(relayOnly());
  const iceServers = handOut.ice_servers;
  state.iceServers = iceServers;
  state.iceErrors = [];
  const iceTransportPolicy = handOut.ice_transport_policy || (relayOnly() ? "relay" : "all");
  const pc = new RTCPeerConnection({ iceServers, iceTransportPolicy });
  state.pc = pc;
  pc.onicecandidateerror = (ev) => {
    state.iceErrors.push({ url: ev.url, errorCode: ev.errorCode, errorText: ev.errorText });
    log(`ICE server ${ev.url}: ${ev.errorCode} ${ev.errorText}`);
  };
  if (iceTransportPolicy === "relay") log(`relay only, via ${iceServers.flatMap((s) => s.urls).join(", ") || "no TURN server"}`);
  if ($("mic").checked) {
    // two-way: the mic goes on the audio transceiver (sendrecv); the browser cancels our own voice
    const mic = await navigator.mediaDevices.getUserMedia({ audio: MIC_CONSTRAINTS });
    state.mic = mic;
    pc.addTrack(mic.getAudioTracks()[0], mic);
    watchMic(mic);
    $("user-state").textContent = "silent";
  } else {
    pc.addTransceiver("audio", { direction: "recvonly" });
  }
  const channel = pc.createDataChannel("events");
  state.channel = channel;
  channel.onmessage = (msg) => onEvent(JSON.parse(msg.data));
  channel.onopen = () => {
    log("data channel open");
    setCanSpeak(pc.connectionState !== "disconnected");
    state.timers.push(setInterval(() => send({ type: "ping", ts: Date.now() }), PING_MS));
  };
  channel.onclose = () => {
    log("data channel closed");
    setCanSpeak(false);
  };
  pc.ontrack = (ev) => attachAudio(ev.streams[0] || new MediaStream([ev.track]));
  pc.onconnectionstatechange = () => onConnectionState(pc);
  await pc.setLocalDescription(await pc.createOffer());
  await waitForIceGathering(pc, 1000);
  const resp = await fetch("/v1/calls", {
    method: "POST",
    headers: { "Content-Type": "application/sdp", ...authHeaders },
    body: pc.localDescription.sdp,
  });
  if (resp.status !== 201) {
    const err = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
    log(`call refused: ${resp.status} ${err.error.message}`);
    await hangup();
    return;
  }
  state.location = resp.headers.get("Location");
  await pc.setRemoteDescription({ type: "answer", sdp: await resp.text() });
  log(`call ${state.location}`);
  state.timers.push(setInterval(pollStats, 500));
}

function attachAudio(stream) {
  // Chrome feeds WebAudio from a remote stream only while a media element plays it.
  $("audio").srcObject = stream;
  const ctx = new AudioContext({ sampleRate: 16000 });
  state.audioCtx = ctx;
  const source = ctx.createMediaStreamSource(stream);
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 512;
  state.analyser = analyser;
  const processor = ctx.createScriptProcessor(256, 1, 1);
  const mute = ctx.createGain();
  mute.gain.value = 0; // the <audio> element plays; this graph only measures
  source.connect(analyser);
  source.connect(processor);
  processor.connect(mute);
  mute.connect(ctx.destination);
  processor.onaudioprocess = (ev) => onPcm(ev.inputBuffer.getChannelData(0));
  ctx.resume();
  state.timers.push(setInterval(drawLevel, 50));
}

function rmsOf(pcm) {
  let sum = 0;
  for (let i = 0; i < pcm.length; i++) sum += pcm[i] * pcm[i];
  return Math.sqrt(sum / pcm.length);
}

// The mic's level, block by block (only recorded while a test asks for it).
function watchMic(stream) {
  const ctx = new AudioContext({ sampleRate: 16000 });
  state.micCtx = ctx;
  const source = ctx.createMediaStreamSource(stream);
  const processor = ctx.createScriptProcessor(256, 1, 1);
  const mute = ctx.createGain();
  mute.gain.value = 0;
  source.connect(processor);
  processor.connect(mute);
  mute.connect(ctx.destination);
  processor.onaudioprocess = (ev) => {
    if (state.levels) state.levels.mic.push([performance.now(), rmsOf(ev.inputBuffer.getChannelData(0))]);
  };
  ctx.resume();
}

function toggleMic() {
  if (!state.mic) return; // before a call the box only chooses two-way or listen-only
  const on = $("mic").checked;
  state.mic.getAudioTracks().forEach((t) => (t.enabled = on));
  log(on ? "microphone on" : "microphone muted");
}

function onPcm(pcm) {
  if (state.capture) state.capture.push(new Float32Array(pcm));
  if (state.levels) state.levels.heard.push([performance.now(), rmsOf(pcm)]);
  if (state.speakAt === null) return;
  let sum = 0;
  for (let i = 0; i < pcm.length; i++) sum += pcm[i] * pcm[i];
  if (Math.sqrt(sum / pcm.length) > HEARD_RMS) {
    state.lastTtfaMs = performance.now() - state.speakAt;
    state.speakAt = null;
    $("s-ttfa").textContent = `${state.lastTtfaMs.toFixed(0)} ms`;
  }
}

function drawLevel() {
  if (!state.analyser) return;
  const buf = new Float32Array(state.analyser.fftSize);
  state.analyser.getFloatTimeDomainData(buf);
  let sum = 0;
  for (const x of buf) sum += x * x;
  const db = 20 * Math.log10(Math.sqrt(sum / buf.length) + 1e-9);
  $("level").style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100))}%`;
}

// The candidate types of the pair ICE selected ({local, remote}: host | srflx | prflx | relay), or null.
async function selectedPair() {
  if (!state.pc) return null;
  const report = await state.pc.getStats();
  let pairId = null;
  report.forEach((s) => {
    if (s.type === "transport" && s.selectedCandidatePairId) pairId = s.selectedCandidatePairId;
  });
  const pair = pairId && report.get(pairId);
  if (!pair) return null;
  const local = report.get(pair.localCandidateId);
  const remote = report.get(pair.remoteCandidateId);
  return { local: local && local.candidateType, remote: remote && remote.candidateType };
}

async function pollStats() {
  if (!state.pc) return;
  const report = await state.pc.getStats();
  report.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      const jb = s.jitterBufferEmittedCount ? (1000 * s.jitterBufferDelay) / s.jitterBufferEmittedCount : 0;
      $("s-jitter").textContent = `${jb.toFixed(0)} ms`;
      $("s-packets").textContent = `${s.packetsReceived} / ${s.packetsLost}`;
    } else if (s.type === "candidate-pair" && s.nominated && s.currentRoundTripTime !== undefined) {
      $("s-rtt").textContent = `${(1000 * s.currentRoundTripTime).toFixed(1)} ms`;
    }
  });
  const pair = await selectedPair();
  if (pair) $("s-path").textContent = `${pair.local} → ${pair.remote}`;
}

function send(message) {
  if (!channelOpen()) {
    if (message.type !== "ping") log(`not connected: ${message.type} not sent`);
    return false;
  }
  state.channel.send(JSON.stringify(message));
  return true;
}

function onEvent(ev) {
  if (ev.type === "pong") return;
  state.events.push(ev);
  state.eventTimes.push(performance.now());
  if (ev.type === "speech.started") $("s-server-ttfa").textContent = `${ev.ttfa_ms.toFixed(0)} ms`;
  if (ev.type === "user.speech.started") setUserState("speaking");
  if (ev.type === "user.speech.stopped") setUserState("silent");
  if (ev.type === "user.transcript") {
    const li = document.createElement("li");
    li.textContent = ev.dropped ? "(not transcribed: too many callers at once)" : ev.text;
    $("transcripts").appendChild(li);
  }
  log(`${ev.type} ${JSON.stringify(ev)}`);
}

function setUserState(text) {
  $("user-state").textContent = text;
  $("user-state").className = text === "speaking" ? "speaking" : "";
}

function speak(text) {
  const message = { type: "speak", text: text === undefined ? $("text").value : text };
  if ($("voice").value) message.voice = $("voice").value;
  if ($("instruct").value.trim()) message.instruct = $("instruct").value.trim();
  if (send(message)) {
    state.speakAt = performance.now();
  }
}

// ---- voices: the picker (GET /v1/voices) and registering a clip (POST /v1/voices) ----------------

async function refreshVoices(select) {
  const resp = await fetch("/v1/voices", { headers: authHeaders }).catch(() => null);
  if (!resp || resp.status !== 200) return [];
  const voices = (await resp.json()).voices;
  const picker = $("voice");
  const keep = select === undefined ? picker.value : select;
  picker.innerHTML = '<option value="">(default)</option>';
  for (const v of voices) {
    const option = document.createElement("option");
    option.value = v.id;
    option.textContent = v.name && v.name !== v.id ? `${v.name} (${v.id})` : v.id;
    option.title = `${v.kind}${v.transcript ? `: ${v.transcript}` : ""}`;
    picker.appendChild(option);
  }
  picker.value = voices.some((v) => v.id === keep) ? keep : "";
  return voices;
}

function setVoiceStatus(text) {
  $("voice-status").textContent = text;
  log(text);
}

function setClip(blob, label) {
  state.clip = blob;
  $("voice-clip").textContent = blob ? `${label} (${(blob.size / 1024).toFixed(0)} KiB)` : "no clip";
}

async function toggleRecord() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  const stream = await navigator.mediaDevices.getUserMedia({ audio: MIC_CONSTRAINTS });
  const recorder = new MediaRecorder(stream);
  const chunks = [];
  recorder.ondataavailable = (ev) => chunks.push(ev.data);
  recorder.onstop = () => {
    stream.getTracks().forEach((t) => t.stop());
    state.recorder = null;
    $("voice-record").textContent = "Record";
    setClip(new Blob(chunks, { type: recorder.mimeType }), "recording");
  };
  state.recorder = recorder;
  recorder.start();
  $("voice-record").textContent = "Stop";
  setVoiceStatus("recording... press Stop when done (1-30 s)");
}

// Register the clip (a Blob/File) as a voice; returns the new voice or null (the reason is shown).
async function registerVoice(clip, transcript, name) {
  clip = clip || state.clip || ($("voice-file").files[0] ?? null);
  if (!clip) {
    setVoiceStatus("choose or record a clip first");
    return null;
  }
  const form = new FormData();
  form.append("audio", clip, clip.name || "clip");
  const words = transcript === undefined ? $("voice-transcript").value.trim() : transcript;
  const label = name === undefined ? $("voice-name").value.trim() : name;
  if (words) form.append("transcript", words);
  if (label) form.append("name", label);
  setVoiceStatus("registering...");
  const resp = await fetch("/v1/voices", { method: "POST", headers: authHeaders, body: form });
  const body = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
  if (resp.status !== 201) {
    setVoiceStatus(`voice refused: ${resp.status} ${body.error.code}: ${body.error.message}`);
    return null;
  }
  setVoiceStatus(`voice ${body.id} registered (${body.kind}, ${body.prompt_s} s)`);
  await refreshVoices(body.id);
  return body;
}

function interrupt() {
  state.speakAt = null;
  send({ type: "interrupt" });
}

async function hangup() {
  state.timers.forEach(clearInterval);
  state.timers = [];
  clearTimeout(state.disconnectTimer);
  state.disconnectTimer = null;
  const { pc, location: url } = state;
  state.pc = null;
  state.channel = null;
  state.location = null;
  if (url) await fetch(url, { method: "DELETE", headers: authHeaders }).catch(() => {});
  if (pc) pc.close();
  if (state.audioCtx) state.audioCtx.close();
  state.audioCtx = null;
  if (state.mic) state.mic.getTracks().forEach((t) => t.stop());
  state.mic = null;
  if (state.micCtx) state.micCtx.close();
  state.micCtx = null;
  $("user-state").textContent = "not listening";
  state.analyser = null;
  setButtons(false);
  setConnection("idle");
}

$("call").onclick = call;
$("hangup").onclick = hangup;
$("speak").onclick = () => speak();
$("interrupt").onclick = interrupt;
$("mic").onchange = toggleMic;
$("voice-record").onclick = () => toggleRecord().catch((err) => setVoiceStatus(`cannot record: ${err.message || err}`));
$("voice-file").onchange = () => setClip($("voice-file").files[0] || null, "file");
$("voice-register").onclick = () => registerVoice();
if (RELAY_QUERY) $("relay").checked = true;
refreshVoices();

window.voicertc = {
  state,
  call,
  hangup,
  speak,
  interrupt,
  refreshVoices,
  registerVoice,
  selectVoice: (id) => {
    $("voice").value = id;
    return $("voice").value === id;
  },
  connectionState: () => (state.pc ? state.pc.connectionState : "idle"),
  selectedPair,
  channelOpen,
  // Block levels of the mic and of what is heard, with performance.now() times (tests, benchmarks).
  recordLevels: () => {
    state.levels = { mic: [], heard: [] };
  },
  takeLevels: () => {
    const levels = state.levels || { mic: [], heard: [] };
    state.levels = { mic: [], heard: [] };
    return levels;
  },
  startCapture: () => {
    state.capture = [];
  },
  // The capture so far as a plain array of samples at 16 kHz (and start a new one).
  takeCapture: () => {
    const chunks = state.capture || [];
    state.capture = [];
    const out = [];
    for (const c of chunks) for (let i = 0; i < c.length; i++) out.push(c[i]);
    return out;
  },
};

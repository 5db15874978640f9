// The Perfetto trace download with its progress on the button: a spinner while the server
// writes the trace (the first download of a revision exports it), then the bytes received of
// the bytes sent, then the browser's own download of the finished file. A failure says why in
// the server's words and leaves the button ready to try again. It knows nothing of what the
// trace holds (backend/perfetto_export.py).

import { ApiError } from "./api.js";
import { $, SEL, el, fill, toast } from "./dom.js";
import { bytes } from "./format.js";

const LABEL = "Perfetto trace";
let busy = false;

export function init() {
  $(SEL.perfetto).addEventListener("click", (e) => {
    e.preventDefault(); // the page fetches it, so that it can say how far it got
    if (!busy) download(e.currentTarget);
  });
}

function state(link, kind, ...content) {
  link.dataset.state = kind;
  link.setAttribute("aria-busy", kind === "preparing" || kind === "receiving" ? "true" : "false");
  fill(link, ...content);
}

// "attachment; filename="a-vs-b.pftrace"" or RFC 5987's filename*=utf-8''...
export function filenameOf(disposition, fallback = "comparison.pftrace") {
  const d = disposition || "";
  const star = d.match(/filename\*\s*=\s*[\w-]+''([^;]+)/i);
  if (star) {
    try {
      return decodeURIComponent(star[1].trim());
    } catch {
      /* fall through to the plain name */
    }
  }
  const plain = d.match(/filename\s*=\s*"?([^";]+)"?/i);
  return plain ? plain[1].trim() : fallback;
}

async function failure(response) {
  try {
    const body = await response.json();
    if (body && body.error) return new ApiError(body.error.type, body.error.message, response.status);
  } catch {
    /* not JSON: said below */
  }
  return new ApiError("InternalError", `the server answered ${response.status}`, response.status);
}

async function download(link) {
  busy = true;
  const href = link.getAttribute("href");
  state(link, "preparing", el("span", { class: "spinner" }), "Preparing trace…");
  try {
    let response;
    try {
      response = await fetch(href);
    } catch (e) {
      throw new ApiError("NetworkError", `cannot reach the bitguard server (${e.message})`, 0);
    }
    if (!response.ok) throw await failure(response);
    const total = Number(response.headers.get("content-length")) || null;
    const chunks = [];
    let received = 0;
    const reader = response.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      chunks.push(value);
      received += value.length;
      const pct = total ? ` (${Math.floor((100 * received) / total)}%)` : "";
      state(link, "receiving", el("span", { class: "spinner" }), `${bytes(received)}${total ? ` of ${bytes(total)}` : ""}${pct}`);
    }
    if (total && received !== total) throw new ApiError("NetworkError", `the download stopped at ${bytes(received)} of ${bytes(total)}`, 0);
    const url = URL.createObjectURL(new Blob(chunks, { type: "application/octet-stream" }));
    const save = el("a", { href: url, download: filenameOf(response.headers.get("content-disposition")) });
    document.body.append(save);
    save.click();
    save.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
    state(link, "done", LABEL);
    link.title = `Downloaded ${bytes(received)}; open it at ui.perfetto.dev`;
  } catch (e) {
    state(link, "error", LABEL);
    toast(`The Perfetto trace could not be downloaded: ${e.message}`, "error");
  } finally {
    busy = false;
  }
}

// The REST API as promises. Every failure becomes an ApiError carrying the server's
// {"error": {"type", "message"}} so views can show the message as it is.

export class ApiError extends Error {
  constructor(type, message, status) {
    super(message);
    this.type = type;
    this.status = status;
  }
}

async function parse(response) {
  if (response.status === 204) return null;
  let body = null;
  try {
    body = await response.json();
  } catch {
    throw new ApiError("InternalError", `the server answered ${response.status} without JSON`, response.status);
  }
  if (!response.ok) {
    const err = body && body.error ? body.error : { type: "InternalError", message: JSON.stringify(body) };
    throw new ApiError(err.type, err.message, response.status);
  }
  return body;
}

async function request(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    throw new ApiError("NetworkError", `cannot reach the bitguard server (${e.message}); is \`bitguard serve\` running?`, 0);
  }
  return parse(response);
}

const q = (params) => {
  const s = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null) s.set(k, v);
  const text = s.toString();
  return text ? `?${text}` : "";
};

export const api = {
  get: (path, params) => request("GET", path + q(params)),
  post: (path, body) => request("POST", path, body === undefined ? {} : body),
  put: (path, body) => request("PUT", path, body),
  del: (path) => request("DELETE", path),

  // files: a FileList from a directory picker; each part is named by its path inside the folder
  uploadRun(files, onProgress) {
    return new Promise((resolve, reject) => {
      const form = new FormData();
      for (const f of files) form.append("files", f, f.webkitRelativePath || f.name);
      const xhr = new XMLHttpRequest();
      xhr.open("POST", "/api/runs");
      xhr.upload.onprogress = (e) => e.lengthComputable && onProgress && onProgress(e.loaded / e.total);
      xhr.onload = () => {
        let body = null;
        try {
          body = JSON.parse(xhr.responseText);
        } catch {
          /* handled below */
        }
        if (xhr.status === 201 && body) resolve(body);
        else if (body && body.error) reject(new ApiError(body.error.type, body.error.message, xhr.status));
        else reject(new ApiError("InternalError", `upload failed with status ${xhr.status}`, xhr.status));
      };
      xhr.onerror = () => reject(new ApiError("NetworkError", "the upload was cut off; is the server still running?", 0));
      xhr.send(form);
    });
  },

  async importRules(file) {
    const form = new FormData();
    form.append("file", file, file.name);
    return parse(await fetch("/api/rulesets/import", { method: "POST", body: form }));
  },
};

export const comparisonPath = (id, rest = "") => `/api/comparisons/${encodeURIComponent(id)}${rest}`;

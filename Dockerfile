# bitguard explorer: `bitguard serve` over a workspace volume, with the CPU build of torch.
#   docker compose up --build        (see docker-compose.yml and the README's Docker section)
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /opt/bitguard
# torch first, from the CPU index: the project pins the same version, so pip keeps this wheel
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY . .
RUN pip install . \
 && useradd --create-home --uid 1000 bitguard \
 && mkdir -p /workspace \
 && chown bitguard /workspace

USER bitguard
VOLUME ["/workspace"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/api/health', timeout=4)"
# inside the container the server listens on every interface; docker-compose.yml publishes
# it on the host's loopback only
CMD ["bitguard", "serve", "--workspace", "/workspace", "--host", "0.0.0.0", "--port", "8000"]

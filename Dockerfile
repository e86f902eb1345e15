# AgentStream: slim, non-root image. Migrations run before the server starts.
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv/agentstream

RUN useradd --create-home --uid 10001 agentstream

COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY migrations ./migrations
RUN pip install . && mkdir -p /srv/agentstream/data && chown -R agentstream /srv/agentstream

USER agentstream
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status == 200 else 1)"

# `agentstream migrate` runs `alembic upgrade head`; then uvicorn serves the app factory.
CMD ["sh", "-c", "agentstream migrate && exec agentstream serve --host ${HOST:-0.0.0.0} --port ${PORT:-8000}"]

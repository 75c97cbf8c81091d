# CPU image: ONNX Runtime engine, SQLite state, the default model prepared at build time.
# Versions: constraints.txt (those the test suite passed with; tools/constraints.py).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    HEALTHBOT_INFERENCE_ENGINES_DIR=/app/engines HEALTHBOT_DATA_DIR=/app/data
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY bot bot
COPY adapters adapters
COPY inference inference
COPY safety safety
COPY engines/README.md engines/README.md
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install -c constraints.txt '.[prepare]' \
 && healthbot prepare-model \
 && pip uninstall -y torch transformers
RUN useradd --create-home healthbot && chown -R healthbot /app
USER healthbot
EXPOSE 8080
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz')"
CMD ["healthbot", "serve", "--host", "0.0.0.0", "--port", "8080"]

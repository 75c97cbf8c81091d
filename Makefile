# healthbot — two commands on a fresh machine:
#   make serve   virtualenv + install + prepare the default model if missing + serve on 127.0.0.1:8080
#   make test    the same set-up, then the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8080
EVAL   ?= ../shared/eval/dev.jsonl

.PHONY: serve test model eval bench kb-check clean

$(STAMP): pyproject.toml
	@echo "healthbot: installing the Python dependencies into $(VENV)/ (first run: a few minutes, quiet)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of PyTorch (only model preparation uses it; serving needs ONNX Runtime alone)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

engines/manifest.json: | $(STAMP)
	@echo "healthbot: preparing the default model into engines/ (first run, once)..."
	$(BIN)/healthbot prepare-model

model: engines/manifest.json

serve: $(STAMP) engines/manifest.json
	$(BIN)/healthbot serve --host $(HOST) --port $(PORT)

# The model's caches (knowledge-base vectors, topic prior, decision head, topic fit: engines/cache) are built
# before the suite, once per change of the model, the knowledge base or the training data
# (minutes on a fresh clone, seconds after), so that no test's server start pays for them.
test: $(STAMP) engines/manifest.json
	@echo "healthbot: building the model's caches in engines/cache if the model or data changed (silent; 10-20 minutes on 2 cores the first time, seconds after)..."
	D=$$(mktemp -d) && HEALTHBOT_DATA_DIR=$$D $(BIN)/healthbot --log-level WARNING ask 你好 >/dev/null; S=$$?; rm -rf $$D; exit $$S
	HEALTHBOT_TEST_CACHES_BUILT=1 $(BIN)/python -m pytest -q

eval: $(STAMP) engines/manifest.json
	$(BIN)/healthbot eval $(EVAL)

bench: $(STAMP) engines/manifest.json
	$(BIN)/healthbot bench

kb-check: $(STAMP)
	$(BIN)/healthbot kb check

clean:
	rm -rf $(VENV) engines/*.onnx engines/*.json engines/*.engine engines/cache data/cache

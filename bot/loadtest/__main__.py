"""``python -m bot.loadtest --abuse junk|long|both``: see :func:`bot.loadtest.abuse.main`."""

from bot.loadtest.abuse import main

if __name__ == "__main__":
    raise SystemExit(main())

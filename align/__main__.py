"""``python -m align``: the ``align`` command (:func:`align.cli.main.main`)."""

from align.cli.main import main

if __name__ == "__main__":
    main()

"""A child (aotbuild/builder/child.py protocol) that returns the values of the variables its spec names."""

import os
import sys

from aotbuild.builder import child

if __name__ == "__main__":
    sys.exit(child.main(sys.argv[1:], lambda spec: {name: os.environ.get(name) for name in spec["names"]}))

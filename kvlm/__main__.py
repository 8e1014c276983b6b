from kvlm.cli import main

raise SystemExit(main())

from gradstats.cli import main

raise SystemExit(main())

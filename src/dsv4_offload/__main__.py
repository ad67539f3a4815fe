from dsv4_offload.cli import main

if __name__ == "__main__":
    main()

/* process.c - this process's resource figures from /proc/self (process.h). */
#include "tandem/process.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* The seconds since the epoch at which the system booted (start times count from boot). */
static double boot_time_s(void)
{
    struct timespec up, now;
    if (clock_gettime(CLOCK_BOOTTIME, &up) != 0 || clock_gettime(CLOCK_REALTIME, &now) != 0)
        return 0;
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9 - (double)up.tv_sec -
           (double)up.tv_nsec / 1e9;
}

/* Resident bytes, CPU seconds and start time from /proc/self/stat. */
static bool read_stat(tdm_process_stats_t *out)
{
    FILE *fp = fopen("/proc/self/stat", "r");
    char buf[1024];
    size_t n = fp ? fread(buf, 1, sizeof buf - 1, fp) : 0;
    if (fp)
        fclose(fp);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    unsigned long long utime, stime, start, rss_pages;
    /* after ") ": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
     * stime cutime cstime priority nice threads itrealvalue starttime vsize rss */
    if (!p || sscanf(p + 2,
                     "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d "
                     "%*d %llu %*u %llu",
                     &utime, &stime, &start, &rss_pages) != 4)
        return false;
    double tick = (double)sysconf(_SC_CLK_TCK);
    out->resident_bytes = rss_pages * (unsigned long long)sysconf(_SC_PAGESIZE);
    out->cpu_seconds = (double)(utime + stime) / tick;
    out->start_time_s = boot_time_s() + (double)start / tick;
    return true;
}

/* Entries of /proc/self/fd but the one the listing itself holds open. */
static uint32_t count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return 0;
    uint32_t n = 0;
    for (struct dirent *e = readdir(d); e; e = readdir(d))
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n > 0 ? n - 1 : 0;
}

bool tdm_process_stats(tdm_process_stats_t *out)
{
    memset(out, 0, sizeof *out);
    if (!read_stat(out)) {
        memset(out, 0, sizeof *out);
        return false;
    }
    out->open_fds = count_fds();
    struct rlimit lim;
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
        out->max_fds = (uint64_t)lim.rlim_cur;
    return true;
}
